//! Writing a cold index file as its entries arrive (`docs/FORMAT.md`, "Cold index
//! files"): pages are written as they fill, the sections after the last page and the
//! header last, so a writer holds one page, the fences (8 bytes a page) and the filter
//! parts (about 1.13 bytes an entry, plus one part's keys while it is built), never
//! the file's entries.

use std::io;

use super::{
    CHECKSUM_LEN, ColdEntry, ColdSegment, FILTER_PARTS, FilterBuilder, HEADER_LEN, Header, MAGIC,
    PAGE_CHECKSUM_OFFSET, PAGE_COUNT_OFFSET, PAGE_ENTRIES, PAGE_LEN, Sections, VERSION, checksum,
};

/// Bytes of pages gathered before one write.
const WRITE_CHUNK: usize = 64 * PAGE_LEN;

/// Writes one generation through `sink(offset, bytes)`, entries in key-hash order.
pub(crate) struct ColdWriter<S: FnMut(u64, &[u8]) -> io::Result<()>> {
    sink: S,
    page: Vec<ColdEntry>,
    pages: u32,
    entries: u64,
    fences: Vec<u64>,
    filter: FilterBuilder,
    /// The trusted entries' filter (16-bit fingerprints).
    trusted: FilterBuilder,
    /// Encoded pages not written yet, and the file offset of the first.
    chunk: Vec<u8>,
    chunk_at: u64,
}

impl<S: FnMut(u64, &[u8]) -> io::Result<()>> ColdWriter<S> {
    /// A writer whose filter is built in parts of `part_keys` distinct hashes, with
    /// 16-bit fingerprints if `wide` (the trusted filter's are always 16-bit).
    pub(crate) fn new(sink: S, part_keys: usize, wide: bool) -> ColdWriter<S> {
        ColdWriter {
            sink,
            page: Vec::with_capacity(PAGE_ENTRIES),
            pages: 0,
            entries: 0,
            fences: Vec::new(),
            filter: FilterBuilder::new(part_keys, wide),
            trusted: FilterBuilder::new(part_keys, true),
            chunk: Vec::with_capacity(WRITE_CHUNK),
            chunk_at: PAGE_LEN as u64,
        }
    }

    /// Entries pushed so far: the next one's position in the file.
    pub(crate) fn len(&self) -> u64 {
        self.entries
    }

    /// The next entry: its key hash not below the last one's.
    pub(crate) fn push(&mut self, entry: ColdEntry) -> io::Result<()> {
        debug_assert!(
            self.page
                .last()
                .is_none_or(|l| l.key_hash <= entry.key_hash)
        );
        match entry.trusted() {
            false => self.filter.push(entry.key_hash),
            true => self.trusted.push(entry.key_hash),
        }
        self.page.push(entry);
        self.entries += 1;
        if self.page.len() == PAGE_ENTRIES {
            self.end_page()?;
        }
        Ok(())
    }

    fn end_page(&mut self) -> io::Result<()> {
        self.fences.push(self.page[0].key_hash);
        self.chunk.extend_from_slice(&encode_page(&self.page));
        self.page.clear();
        self.pages = self.pages.checked_add(1).expect("pages fit u32");
        if self.chunk.len() >= WRITE_CHUNK {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        write_out(&mut self.sink, &mut self.chunk_at, &mut self.chunk)
    }

    /// Writes the last page, the sections (`segments`: the segment table every
    /// entry's `segment` indexes) and the header; returns them, as a reader would
    /// decode them. `None`, with nothing more written, if no entry was pushed (a file
    /// has at least one).
    pub(crate) fn finish(
        mut self,
        generation: u64,
        segments: &[ColdSegment],
    ) -> io::Result<Option<(Header, Sections)>> {
        if self.entries == 0 {
            return Ok(None);
        }
        assert!(!segments.is_empty());
        if !self.page.is_empty() {
            self.end_page()?;
        }
        self.flush()?;
        let filter = self.filter.finish();
        let trusted = self.trusted.finish();
        let header = Header {
            generation,
            segment_count: u32::try_from(segments.len()).expect("segments fit u32"),
            page_count: self.pages,
            entry_count: self.entries,
            filter_len: u32::try_from(filter.encoded_len()).expect("a filter fits u32"),
            filter_kind: FILTER_PARTS,
            trusted_len: match trusted.is_empty() {
                true => 0,
                false => u32::try_from(trusted.encoded_len()).expect("a filter fits u32"),
            },
        };
        let mut section = SectionWriter {
            sink: &mut self.sink,
            at: header.sections_offset(),
            buffer: Vec::new(),
            hasher: xxhash_rust::xxh3::Xxh3::new(),
        };
        for segment in segments {
            section.put(&segment.seq.to_le_bytes())?;
            section.put(&segment.bucket_deadline_ms.to_le_bytes())?;
            section.put(&segment.covered_len.to_le_bytes())?;
        }
        section.end()?;
        section.put_filter(&filter)?;
        for fence in &self.fences {
            section.put(&fence.to_le_bytes())?;
        }
        section.end()?;
        if !trusted.is_empty() {
            section.put_filter(&trusted)?;
        }
        debug_assert_eq!(section.at, header.file_len());
        let mut first = vec![0u8; PAGE_LEN];
        first[..HEADER_LEN].copy_from_slice(&encode_header(&header));
        (self.sink)(0, &first)?;
        Ok(Some((
            header,
            Sections {
                segments: segments.to_vec(),
                filter,
                trusted,
                fences: self.fences,
            },
        )))
    }
}

/// Writes one section a piece at a time, then its checksum.
struct SectionWriter<'s, S: FnMut(u64, &[u8]) -> io::Result<()>> {
    sink: &'s mut S,
    at: u64,
    buffer: Vec<u8>,
    hasher: xxhash_rust::xxh3::Xxh3,
}

impl<S: FnMut(u64, &[u8]) -> io::Result<()>> SectionWriter<'_, S> {
    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.hasher.update(bytes);
        self.buffer.extend_from_slice(bytes);
        if self.buffer.len() >= WRITE_CHUNK {
            self.write()?;
        }
        Ok(())
    }

    fn write(&mut self) -> io::Result<()> {
        write_out(self.sink, &mut self.at, &mut self.buffer)
    }

    /// A whole filter section, ended.
    fn put_filter(&mut self, filter: &super::FilterParts) -> io::Result<()> {
        let mut failed = Ok(());
        filter.encode(|bytes| {
            if failed.is_ok() {
                failed = self.put(bytes);
            }
        });
        failed?;
        self.end()
    }

    /// Ends the section with its checksum; the next one starts after it.
    fn end(&mut self) -> io::Result<()> {
        let sum = self.hasher.digest();
        self.buffer.extend_from_slice(&sum.to_le_bytes());
        self.write()?;
        self.hasher.reset();
        debug_assert_eq!(CHECKSUM_LEN, 8);
        Ok(())
    }
}

/// Writes `buffer` at `*at` (if not empty), then moves `*at` past it and empties it.
fn write_out(
    sink: &mut impl FnMut(u64, &[u8]) -> io::Result<()>,
    at: &mut u64,
    buffer: &mut Vec<u8>,
) -> io::Result<()> {
    if !buffer.is_empty() {
        sink(*at, buffer)?;
        *at += buffer.len() as u64;
        buffer.clear();
    }
    Ok(())
}

/// Encodes a whole file in memory. `entries` must be sorted by key hash (then
/// anything), every `segment` a position in `segments`; neither may be empty. The
/// exact filter has 16-bit fingerprints if `wide`.
pub(crate) fn encode(
    generation: u64,
    segments: &[ColdSegment],
    entries: &[ColdEntry],
    wide: bool,
) -> Vec<u8> {
    encode_in_parts(generation, segments, entries, super::PART_KEYS, wide)
}

/// [`encode`] with filter parts of `part_keys` distinct hashes.
pub(crate) fn encode_in_parts(
    generation: u64,
    segments: &[ColdSegment],
    entries: &[ColdEntry],
    part_keys: usize,
    wide: bool,
) -> Vec<u8> {
    assert!(!segments.is_empty() && !entries.is_empty());
    debug_assert!(
        entries
            .iter()
            .all(|e| (e.segment as usize) < segments.len())
    );
    let mut out = Vec::new();
    let sink = |at: u64, bytes: &[u8]| -> io::Result<()> {
        let at = at as usize;
        if out.len() < at + bytes.len() {
            out.resize(at + bytes.len(), 0);
        }
        out[at..at + bytes.len()].copy_from_slice(bytes);
        Ok(())
    };
    let mut writer = ColdWriter::new(sink, part_keys, wide);
    for &entry in entries {
        writer.push(entry).expect("writing to memory");
    }
    let (header, _) = writer
        .finish(generation, segments)
        .expect("writing to memory")
        .expect("one entry or more");
    debug_assert_eq!(out.len() as u64, header.file_len());
    out
}

pub(crate) fn encode_header(header: &Header) -> [u8; HEADER_LEN] {
    let mut out = [0u8; HEADER_LEN];
    out[0..8].copy_from_slice(&MAGIC);
    out[8..12].copy_from_slice(&VERSION.to_le_bytes());
    out[12..16].copy_from_slice(&(HEADER_LEN as u32).to_le_bytes());
    out[16..24].copy_from_slice(&header.generation.to_le_bytes());
    out[24..28].copy_from_slice(&header.segment_count.to_le_bytes());
    out[28..32].copy_from_slice(&header.page_count.to_le_bytes());
    out[32..40].copy_from_slice(&header.entry_count.to_le_bytes());
    out[40..44].copy_from_slice(&header.filter_len.to_le_bytes());
    out[44] = header.filter_kind;
    out[48..52].copy_from_slice(&header.trusted_len.to_le_bytes());
    let sum = checksum(&out[..56]);
    out[56..64].copy_from_slice(&sum.to_le_bytes());
    out
}

/// One entry page: `entries` (1 to 255 of them), sorted.
pub(crate) fn encode_page(entries: &[ColdEntry]) -> [u8; PAGE_LEN] {
    assert!(!entries.is_empty() && entries.len() <= PAGE_ENTRIES);
    let mut out = [0u8; PAGE_LEN];
    for (i, entry) in entries.iter().enumerate() {
        let at = i * super::ENTRY_LEN;
        out[at..at + 8].copy_from_slice(&entry.key_hash.to_le_bytes());
        out[at + 8..at + 12].copy_from_slice(&entry.segment.to_le_bytes());
        out[at + 12..at + 16].copy_from_slice(&entry.field.to_le_bytes());
    }
    out[PAGE_COUNT_OFFSET..PAGE_COUNT_OFFSET + 4]
        .copy_from_slice(&(entries.len() as u32).to_le_bytes());
    let sum = checksum(&out[..PAGE_CHECKSUM_OFFSET]);
    out[PAGE_CHECKSUM_OFFSET..].copy_from_slice(&sum.to_le_bytes());
    out
}
