//! The allocator of the index tables: large tables straight from the kernel.

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
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct TableAlloc;

fn is_mapped(layout: Layout) -> bool {
    layout.size() >= TABLE_MMAP_MIN && layout.align() <= 4096
}

// SAFETY: blocks from `allocate` are valid for `layout` until `deallocate`; mapped
// blocks are page-aligned (so aligned for any `layout.align() <= 4096`) and zeroed,
// and every block goes back to the allocator it came from, chosen by the same
// `is_mapped(layout)` on both sides.
unsafe impl Allocator for TableAlloc {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        if !is_mapped(layout) {
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
        if !is_mapped(layout) {
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
