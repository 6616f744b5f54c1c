//! The allocator of the index tables: in a store without a memory budget, large tables
//! straight from the kernel.

use std::alloc::Layout;
use std::ptr::NonNull;

use allocator_api2::alloc::{AllocError, Allocator, Global};

/// Tables from this size up are mapped straight from the kernel (and unmapped when
/// freed); smaller ones come from the global allocator.
const TABLE_MMAP_MIN: usize = 4096;

/// The allocator of the index tables. A table doubles by allocating the new one and
/// freeing the old; from the global allocator, the freed halves mostly stay resident
/// in its heap (glibc raises its mmap threshold after the first large free). Mapping
/// large tables directly returns each old table to the kernel when it is freed, so
/// the process holds only the live tables: the memory-per-key figure is the index.
///
/// That is for stores without a memory budget, whose tables only grow. Under a budget
/// the tables shrink after every spill and grow back, and each unmapping is a TLB
/// shootdown, an interrupt to every other core the process runs on (30M keys at an
/// 80 MiB budget: 62K `munmap`s in all; at 100M and 256 MiB, the interrupts took ~6%
/// of the writers' samples). A budgeted store's tables come from the global
/// allocator, whose free memory the trims hand back (`cold::release_free_memory`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct TableAlloc {
    /// Tables from [`TABLE_MMAP_MIN`] up are mapped (no memory budget).
    mapped: bool,
}

impl TableAlloc {
    /// The allocator of a store's tables: `budgeted`, a store with a memory budget.
    pub(crate) fn for_store(budgeted: bool) -> TableAlloc {
        TableAlloc { mapped: !budgeted }
    }

    fn is_mapped(&self, layout: Layout) -> bool {
        self.mapped && layout.size() >= TABLE_MMAP_MIN && layout.align() <= 4096
    }
}

// SAFETY: blocks from `allocate` are valid for `layout` until `deallocate`; mapped
// blocks are page-aligned (so aligned for any `layout.align() <= 4096`) and zeroed,
// and every block goes back to the allocator it came from, chosen by the same
// `is_mapped(layout)` on both sides (`mapped` never changes: the allocator is `Copy`
// and each table keeps the one it was made with).
unsafe impl Allocator for TableAlloc {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        if !self.is_mapped(layout) {
            return Global.allocate(layout);
        }
        // SAFETY: an anonymous private mapping; no memory is passed in.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                layout.size(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(AllocError);
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(AllocError)?;
        Ok(NonNull::slice_from_raw_parts(ptr, layout.size()))
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        if !self.is_mapped(layout) {
            // SAFETY: the caller passes a block `allocate` got from `Global` for
            // this same layout.
            return unsafe { Global.deallocate(ptr, layout) };
        }
        // SAFETY: the caller passes a block `allocate` mapped with this size.
        unsafe {
            libc::munmap(ptr.as_ptr().cast(), layout.size());
        }
    }
}
