//! Cold index files (issue 11): the index entries of sealed buckets, moved out of RAM
//! once the memory budget is exceeded, written once and never changed. One file is one
//! *generation*, numbered in the order files are written (spills and merges alike; the
//! lookup order is the tier's list, kept in `COLD_STATE` at a clean close). `docs/FORMAT.md`
//! ("Cold index files") is the specification; the constants below mirror it.
//!
//! ```text
//! page 0: the header (64 bytes), then zeros to 4096
//! offset size field
//! 0      8    magic          b"IDEMCOLD"
//! 8      4    version        2
//! 12     4    header_len     64
//! 16     8    generation     its number (the next one at each spill or merge)
//! 24     4    segment_count  entries of the segment table (1 or more)
//! 28     4    page_count     entry pages (1 or more)
//! 32     8    entry_count    entries in all pages
//! 40     4    filter_len     bytes of the filter section (0: no filter)
//! 44     1    filter_kind    2 filter parts (the only kind written and read)
//! 45     3    reserved       zero
//! 48     4    trusted_len    bytes of the trusted filter section (0: no section)
//! 52     4    reserved       zero
//! 56     8    checksum       xxh3-64 of bytes 0..56
//!
//! pages 1..=page_count, 4096 bytes each: the entries sorted by key hash
//! 0      16n  entries (n = 255 in every page but the last, 1..=255 there)
//!             0  8  key_hash   KeyHash of the record's key
//!             8  4  segment    position in the segment table
//!             12 4  offset     of the record in that segment (bits 0..24; bit 31
//!                              set for a trusted entry)
//! 16n    ..   zeros up to 4080
//! 4080   4    entry_count      n
//! 4084   4    reserved         zero
//! 4088   8    checksum         xxh3-64 of the page's bytes 0..4088
//!
//! then the sections (four with a trusted filter), each followed by an 8-byte xxh3-64
//! of its bytes:
//! segment table  segment_count × (segment_seq u64, bucket_deadline u64,
//!                covered_len u64: the segment's length the entries cover)
//! filter         filter_len bytes (cold_index::filter::FilterParts), over the
//!                entries that are not trusted: u32 part count, then per part (up to
//!                2^22 distinct hashes each, in hash order): u64 first key hash, u8
//!                kind (0 none: every probe says maybe, 1 binary fuse 8, 2 binary
//!                fuse 16), 3 zero bytes, u32 length, then for kinds 1 and 2 u64
//!                seed, u32 segment_length, u32 mask, u32 segment_count_length and the
//!                8-bit (16-bit, little-endian) fingerprints
//! fences         page_count × u64: the first key hash of each page
//! trusted filter trusted_len bytes laid out as the filter (parts of kind 2, or 0),
//!                over the trusted entries' hashes (approximate namespaces)
//! ```
//!
//! The file's length is exactly what the header's counts make it. Opening a generation
//! reads the header and the sections (about 1.2 bytes per entry) and checks every
//! checksum; a page is read, and its checksum checked, only when a lookup needs it.
//! Every decoder here checks every bound, allocates nothing it was not told to by a
//! checksummed count, and never panics, whatever the bytes.

use super::{read_u32, read_u64};
mod filter;
mod prefetch;
mod write;

pub(crate) use filter::{FilterBuilder, FilterParts, PART_KEYS};
pub(crate) use write::ColdWriter;
#[cfg(any(test, feature = "testing"))]
pub(crate) use write::encode;
#[cfg(test)]
use write::{encode_in_parts, encode_page};

pub(crate) const MAGIC: [u8; 8] = *b"IDEMCOLD";
pub(crate) const VERSION: u32 = 2;
/// The header's `filter_kind`: filter parts.
pub(crate) const FILTER_PARTS: u8 = 2;
/// The unit of the file: the header's page and each entry page.
pub(crate) const PAGE_LEN: usize = 4096;
pub(crate) const HEADER_LEN: usize = 64;
pub(crate) const ENTRY_LEN: usize = 16;
/// Entries in a full page.
pub(crate) const PAGE_ENTRIES: usize = 255;
pub(crate) const PAGE_COUNT_OFFSET: usize = PAGE_LEN - 16;
pub(crate) const PAGE_CHECKSUM_OFFSET: usize = PAGE_LEN - 8;
const _: () = assert!(PAGE_ENTRIES * ENTRY_LEN <= PAGE_COUNT_OFFSET);
pub(crate) const SEGMENT_LEN: usize = 24;
pub(crate) const CHECKSUM_LEN: usize = 8;

/// One index entry: where the record of a key with this hash lives. 16 bytes, as in
/// the file (a spill collects a bucket's entries in RAM before writing them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct ColdEntry {
    pub key_hash: u64,
    /// A position in the file's segment table.
    pub segment: u32,
    /// The offset field as a page holds it: the record's offset in bits 0..24
    /// (segments are at most 16 MiB) and [`TRUSTED_BIT`].
    pub field: u32,
}
const _: () = assert!(std::mem::size_of::<ColdEntry>() == 16);

/// The offset field's top bit: the key's namespace was approximate when the entry was
/// spilled, and its hash is in the trusted filter, not the exact one.
pub(crate) const TRUSTED_BIT: u32 = 1 << 31;
/// The offset field's bits a record offset may use.
pub(crate) const OFFSET_MASK: u32 = (1 << 24) - 1;

impl ColdEntry {
    pub(crate) fn new(key_hash: u64, segment: u32, offset: u32, trusted: bool) -> ColdEntry {
        debug_assert!(offset <= OFFSET_MASK);
        ColdEntry {
            key_hash,
            segment,
            field: offset | if trusted { TRUSTED_BIT } else { 0 },
        }
    }

    /// From a page's segment and offset fields; `None` if the offset field uses bits
    /// neither an offset nor the trusted flag may.
    pub(crate) fn decode(key_hash: u64, segment: u32, field: u32) -> Option<ColdEntry> {
        (field & !(TRUSTED_BIT | OFFSET_MASK) == 0).then_some(ColdEntry {
            key_hash,
            segment,
            field,
        })
    }

    /// The record's offset in its segment.
    #[inline]
    pub(crate) fn offset(&self) -> u32 {
        self.field & OFFSET_MASK
    }

    /// The entry is trusted (`Policy::approximate`).
    #[inline]
    pub(crate) fn trusted(&self) -> bool {
        self.field & TRUSTED_BIT != 0
    }
}

/// A segment a generation's entries point into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ColdSegment {
    pub seq: u64,
    pub bucket_deadline_ms: u64,
    /// The segment's records before this offset are covered by the generation (it
    /// was this long when the entries were taken); an open replays only what follows.
    pub covered_len: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub generation: u64,
    pub segment_count: u32,
    pub page_count: u32,
    pub entry_count: u64,
    pub filter_len: u32,
    pub filter_kind: u8,
    /// Bytes of the trusted filter section (0: none, and no section).
    pub trusted_len: u32,
}

impl Header {
    /// Where the sections start: after the header's page and the entry pages.
    pub(crate) fn sections_offset(&self) -> u64 {
        (1 + u64::from(self.page_count)) * PAGE_LEN as u64
    }

    pub(crate) fn sections_len(&self) -> u64 {
        let trusted = match self.trusted_len {
            0 => 0,
            len => u64::from(len) + CHECKSUM_LEN as u64,
        };
        u64::from(self.segment_count) * SEGMENT_LEN as u64
            + u64::from(self.filter_len)
            + u64::from(self.page_count) * 8
            + 3 * CHECKSUM_LEN as u64
            + trusted
    }

    /// The exact length of the file.
    pub(crate) fn file_len(&self) -> u64 {
        self.sections_offset() + self.sections_len()
    }

    /// Where page `page` (0-based among the entry pages) starts.
    pub(crate) fn page_offset(&self, page: u32) -> u64 {
        (1 + u64::from(page)) * PAGE_LEN as u64
    }
}

/// Why bytes are not a cold index file (or a part of one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ColdError {
    Truncated,
    Invalid(&'static str),
    Checksum(&'static str),
}

impl ColdError {
    pub(crate) fn reason(self) -> &'static str {
        match self {
            ColdError::Truncated => "cold index file truncated",
            ColdError::Invalid(why) | ColdError::Checksum(why) => why,
        }
    }
}

pub(crate) fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// Decodes and verifies the header at the start of `bytes`.
pub(crate) fn decode_header(bytes: &[u8]) -> Result<Header, ColdError> {
    if bytes.len() < HEADER_LEN {
        return Err(ColdError::Truncated);
    }
    if bytes[0..8] != MAGIC {
        return Err(ColdError::Invalid("not a cold index file (bad magic)"));
    }
    if read_u64(bytes, 56) != checksum(&bytes[..56]) {
        return Err(ColdError::Checksum("cold index header checksum mismatch"));
    }
    if read_u32(bytes, 8) != VERSION {
        return Err(ColdError::Invalid("unsupported cold index version"));
    }
    let reserved_zero = bytes[45..48].iter().all(|&b| b == 0) && read_u32(bytes, 52) == 0;
    if read_u32(bytes, 12) as usize != HEADER_LEN || !reserved_zero {
        return Err(ColdError::Invalid("cold index header fields out of range"));
    }
    let header = Header {
        generation: read_u64(bytes, 16),
        segment_count: read_u32(bytes, 24),
        page_count: read_u32(bytes, 28),
        entry_count: read_u64(bytes, 32),
        filter_len: read_u32(bytes, 40),
        filter_kind: bytes[44],
        trusted_len: read_u32(bytes, 48),
    };
    let pages = u64::from(header.page_count);
    let full_pages = header.entry_count.div_ceil(PAGE_ENTRIES as u64);
    if header.segment_count == 0 || header.page_count == 0 || full_pages != pages {
        return Err(ColdError::Invalid("cold index counts disagree"));
    }
    Ok(header)
}

/// The sections of a generation: what stays in RAM while it is open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Sections {
    pub segments: Vec<ColdSegment>,
    /// The exact filter: the hashes of the entries that are not trusted.
    pub filter: FilterParts,
    /// The trusted filter (16-bit fingerprints): the hashes of the trusted entries.
    pub trusted: FilterParts,
    /// The first key hash of each page.
    pub fences: Vec<u64>,
}

impl Sections {
    /// Whether either filter may hold `key_hash` (an exact lookup reads the pages).
    #[inline]
    pub(crate) fn may_contain(&self, key_hash: u64) -> bool {
        self.filter.may_contain(key_hash)
            || (!self.trusted.is_empty() && self.trusted.may_contain(key_hash))
    }

    /// Starts the filter reads that `may_contain(key_hash)` makes, without waiting.
    #[inline]
    pub(crate) fn prefetch(&self, key_hash: u64) {
        self.filter.prefetch(key_hash);
        if !self.trusted.is_empty() {
            self.trusted.prefetch(key_hash);
        }
    }
}

/// Decodes and verifies the sections: `bytes` is the file from
/// `header.sections_offset()` to its end.
pub(crate) fn decode_sections(header: &Header, bytes: &[u8]) -> Result<Sections, ColdError> {
    if (bytes.len() as u64) < header.sections_len() {
        return Err(ColdError::Truncated);
    }
    if bytes.len() as u64 != header.sections_len() {
        return Err(ColdError::Invalid("cold index file longer than its counts"));
    }
    let mut at = 0;
    let mut section = |len: usize, what: &'static str| -> Result<&[u8], ColdError> {
        let body = &bytes[at..at + len];
        if read_u64(bytes, at + len) != checksum(body) {
            return Err(ColdError::Checksum(what));
        }
        at += len + CHECKSUM_LEN;
        Ok(body)
    };
    let table = section(
        header.segment_count as usize * SEGMENT_LEN,
        "cold index segment table checksum mismatch",
    )?;
    let filter = section(
        header.filter_len as usize,
        "cold index filter checksum mismatch",
    )?;
    let fences = section(
        header.page_count as usize * 8,
        "cold index fences checksum mismatch",
    )?;
    let trusted = match header.trusted_len {
        0 => None,
        len => Some(section(
            len as usize,
            "cold index trusted filter checksum mismatch",
        )?),
    };
    let segments = table
        .chunks_exact(SEGMENT_LEN)
        .map(|s| ColdSegment {
            seq: read_u64(s, 0),
            bucket_deadline_ms: read_u64(s, 8),
            covered_len: read_u64(s, 16),
        })
        .collect();
    let filter = (header.filter_kind == FILTER_PARTS)
        .then(|| FilterParts::decode(filter, false))
        .flatten()
        .ok_or(ColdError::Invalid(
            "cold index filter does not fit its fingerprints",
        ))?;
    let trusted = match trusted {
        None => FilterParts::empty(),
        Some(bytes) => FilterParts::decode(bytes, true)
            .filter(|t| !t.is_empty())
            .ok_or(ColdError::Invalid(
                "cold index trusted filter does not fit its fingerprints",
            ))?,
    };
    let fences: Vec<u64> = fences.chunks_exact(8).map(|f| read_u64(f, 0)).collect();
    if fences.windows(2).any(|w| w[0] > w[1]) {
        return Err(ColdError::Invalid("cold index fences out of order"));
    }
    Ok(Sections {
        segments,
        filter,
        trusted,
        fences,
    })
}

/// Page `page`'s bytes with its checksum verified and its count: exactly what the
/// header's entry count gives that page (255 in every page but the last), and the
/// reserved word zero.
fn verified_page<'a>(
    header: &Header,
    page: u32,
    bytes: &'a [u8],
) -> Result<(&'a [u8], usize), ColdError> {
    if bytes.len() < PAGE_LEN {
        return Err(ColdError::Truncated);
    }
    let bytes = &bytes[..PAGE_LEN];
    if read_u64(bytes, PAGE_CHECKSUM_OFFSET) != checksum(&bytes[..PAGE_CHECKSUM_OFFSET]) {
        return Err(ColdError::Checksum("cold index page checksum mismatch"));
    }
    let count = read_u32(bytes, PAGE_COUNT_OFFSET) as usize;
    let expected = if page + 1 == header.page_count {
        header
            .entry_count
            .saturating_sub(u64::from(page) * PAGE_ENTRIES as u64) as usize
    } else {
        PAGE_ENTRIES
    };
    if count != expected || count > PAGE_ENTRIES || read_u32(bytes, PAGE_COUNT_OFFSET + 4) != 0 {
        return Err(ColdError::Invalid("cold index page count disagrees"));
    }
    Ok((bytes, count))
}

/// Decodes and verifies entry page `page` of a generation: its checksum, its count
/// (255 in every page but the last), its order, that it starts at its fence and ends
/// at or before the next one, and that every entry names a segment of the table.
/// Appends its entries to `out`.
pub(crate) fn decode_page(
    header: &Header,
    sections: &Sections,
    page: u32,
    bytes: &[u8],
    out: &mut Vec<ColdEntry>,
) -> Result<(), ColdError> {
    let (bytes, count) = verified_page(header, page, bytes)?;
    let Some(&fence) = sections.fences.get(page as usize) else {
        return Err(ColdError::Invalid("cold index page beyond the last"));
    };
    let next_fence = sections.fences.get(page as usize + 1).copied();
    let start = out.len();
    let mut previous = fence;
    for i in 0..count {
        let at = i * ENTRY_LEN;
        let Some(entry) = ColdEntry::decode(
            read_u64(bytes, at),
            read_u32(bytes, at + 8),
            read_u32(bytes, at + 12),
        ) else {
            out.truncate(start);
            return Err(ColdError::Invalid("cold index entry offset out of range"));
        };
        let in_order = if i == 0 {
            entry.key_hash == fence
        } else {
            entry.key_hash >= previous
        };
        if !in_order || next_fence.is_some_and(|next| entry.key_hash > next) {
            out.truncate(start);
            return Err(ColdError::Invalid("cold index page out of order"));
        }
        if entry.segment as usize >= sections.segments.len() {
            out.truncate(start);
            return Err(ColdError::Invalid("cold index entry names no segment"));
        }
        previous = entry.key_hash;
        out.push(entry);
    }
    if bytes[count * ENTRY_LEN..PAGE_COUNT_OFFSET]
        .iter()
        .any(|&b| b != 0)
    {
        out.truncate(start);
        return Err(ColdError::Invalid(
            "cold index page has bytes past its entries",
        ));
    }
    Ok(())
}

/// The entries of page `page` whose key hash is `key_hash`, with their positions in
/// the page: what a lookup reads. The page's checksum and count are verified (as
/// `decode_page` does), then the sorted entries are binary-searched in place instead
/// of decoded; every entry returned names a segment of the table.
pub(crate) fn find_in_page(
    header: &Header,
    sections: &Sections,
    page: u32,
    bytes: &[u8],
    key_hash: u64,
    out: &mut Vec<(usize, ColdEntry)>,
) -> Result<(), ColdError> {
    let (bytes, count) = verified_page(header, page, bytes)?;
    let hash_at = |i: usize| read_u64(bytes, i * ENTRY_LEN);
    // The first entry whose hash is not below `key_hash` (sorted, checksummed).
    let (mut lo, mut hi) = (0, count);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if hash_at(mid) < key_hash {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    for i in lo..count {
        if hash_at(i) != key_hash {
            break;
        }
        let at = i * ENTRY_LEN;
        let Some(entry) =
            ColdEntry::decode(key_hash, read_u32(bytes, at + 8), read_u32(bytes, at + 12))
        else {
            return Err(ColdError::Invalid("cold index entry offset out of range"));
        };
        if entry.segment as usize >= sections.segments.len() {
            return Err(ColdError::Invalid("cold index entry names no segment"));
        }
        out.push((i, entry));
    }
    Ok(())
}

/// The pages that may hold entries with `key_hash`: from the last page whose fence is
/// below it (equal hashes may end the page before) through the last page whose fence
/// is at most it. Empty if it is below every fence.
pub(crate) fn pages_for(fences: &[u64], key_hash: u64) -> std::ops::Range<u32> {
    let through = fences.partition_point(|&f| f <= key_hash);
    if through == 0 {
        return 0..0;
    }
    let from = fences.partition_point(|&f| f < key_hash).saturating_sub(1);
    from as u32..through as u32
}

/// The entries of a generation whose key hash is `key_hash` (none if the filter rules
/// it out): the filter, then the fences, then each page that may hold it, read through
/// `read_page(page, buffer)` and verified. A page that fails is an error: the caller
/// cannot know what it held.
pub(crate) fn find<E>(
    header: &Header,
    sections: &Sections,
    key_hash: u64,
    mut read_page: impl FnMut(u32, &mut [u8; PAGE_LEN]) -> Result<(), E>,
    out: &mut Vec<ColdEntry>,
) -> Result<(), FindError<E>> {
    if !sections.may_contain(key_hash) {
        return Ok(());
    }
    let mut page_bytes = [0u8; PAGE_LEN];
    let mut entries = Vec::new();
    for page in pages_for(&sections.fences, key_hash) {
        read_page(page, &mut page_bytes).map_err(FindError::Read)?;
        entries.clear();
        decode_page(header, sections, page, &page_bytes, &mut entries).map_err(FindError::Page)?;
        out.extend(entries.iter().filter(|e| e.key_hash == key_hash));
    }
    Ok(())
}

/// Why [`find`] could not answer.
#[derive(Debug)]
pub(crate) enum FindError<E> {
    /// Reading the page failed.
    Read(E),
    /// The page is damaged.
    Page(ColdError),
}

/// A whole file, every page decoded and the filter rebuilt from the entries and
/// compared (for `verify`, the fuzz target and tests; a store reads pages one at a
/// time and trusts the filter's checksum).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Decoded {
    pub header: Header,
    pub sections: Sections,
    pub entries: Vec<ColdEntry>,
}

/// Decodes and verifies a whole file.
pub(crate) fn decode_file(bytes: &[u8]) -> Result<Decoded, ColdError> {
    let header = decode_header(bytes)?;
    if (bytes.len() as u64) < header.file_len() {
        return Err(ColdError::Truncated);
    }
    if bytes.len() as u64 != header.file_len() {
        return Err(ColdError::Invalid("cold index file longer than its counts"));
    }
    if bytes[HEADER_LEN..PAGE_LEN].iter().any(|&b| b != 0) {
        return Err(ColdError::Invalid(
            "cold index header page has bytes past the header",
        ));
    }
    let sections = decode_sections(&header, &bytes[header.sections_offset() as usize..])?;
    let mut entries = Vec::new();
    for page in 0..header.page_count {
        let at = header.page_offset(page) as usize;
        decode_page(&header, &sections, page, &bytes[at..], &mut entries)?;
    }
    // The filters must be the ones the entries make: a filter that misses an entry is
    // a wrong answer (a duplicate taken for a fresh key), whatever its checksum says.
    let hashes = |trusted: bool| -> Vec<u64> {
        entries
            .iter()
            .filter(|e| e.trusted() == trusted)
            .map(|e| e.key_hash)
            .collect()
    };
    if !sections.filter.is_built_from(&hashes(false))
        || !sections.trusted.is_built_from(&hashes(true))
    {
        return Err(ColdError::Invalid(
            "cold index filter is not its entries' filter",
        ));
    }
    Ok(Decoded {
        header,
        sections,
        entries,
    })
}

#[cfg(test)]
mod tests;
