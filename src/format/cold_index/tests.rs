//! The cold index codec's tests.

use super::*;

fn entries(n: usize, seed: u64) -> Vec<ColdEntry> {
    let mut out: Vec<ColdEntry> = (0..n as u64)
        .map(|i| {
            ColdEntry::new(
                xxhash_rust::xxh3::xxh3_64_with_seed(&i.to_le_bytes(), seed),
                (i % 3) as u32,
                64 + (i as u32) * 40,
                i % 5 == 0,
            )
        })
        .collect();
    out.sort();
    out
}

const SEGMENTS: [ColdSegment; 3] = [
    ColdSegment {
        seq: 7,
        bucket_deadline_ms: 1_000,
        covered_len: 4096,
    },
    ColdSegment {
        seq: 8,
        bucket_deadline_ms: 1_000,
        covered_len: 4096,
    },
    ColdSegment {
        seq: 12,
        bucket_deadline_ms: 2_000,
        covered_len: 4096,
    },
];

/// The header and sections, as a store opens a generation (no page read).
struct Opened {
    header: Header,
    sections: Sections,
}

fn open(bytes: &[u8]) -> Result<Opened, ColdError> {
    let header = decode_header(bytes)?;
    if bytes.len() as u64 != header.file_len() {
        return Err(ColdError::Invalid("length"));
    }
    let sections = decode_sections(&header, &bytes[header.sections_offset() as usize..])?;
    Ok(Opened { header, sections })
}

/// `find` over the file's bytes in memory.
fn find_in(bytes: &[u8], opened: &Opened, key_hash: u64) -> Vec<ColdEntry> {
    let mut found = Vec::new();
    let read = |page: u32, out: &mut [u8; PAGE_LEN]| -> Result<(), ()> {
        let at = opened.header.page_offset(page) as usize;
        out.copy_from_slice(&bytes[at..at + PAGE_LEN]);
        Ok(())
    };
    find(&opened.header, &opened.sections, key_hash, read, &mut found).unwrap();
    found
}

#[test]
fn a_file_round_trips_and_every_key_is_found_through_filter_and_fences() {
    for (n, wide) in [1, 254, 255, 256, 1_000, 20_000]
        .into_iter()
        .flat_map(|n| [(n, false), (n, true)])
    {
        let written = entries(n, 1);
        let bytes = encode(5, &SEGMENTS, &written, wide);
        let opened = open(&bytes).unwrap();
        assert_eq!(opened.header.generation, 5);
        assert_eq!(opened.header.entry_count, n as u64);
        assert_eq!(opened.sections.segments, SEGMENTS);
        let decoded = decode_file(&bytes).unwrap();
        assert_eq!(decoded.entries, written);
        assert_eq!(decoded.sections, opened.sections);
        // (With one key, the only entry is trusted: the exact filter has no part.)
        assert_eq!(decoded.sections.filter.is_wide(), wide && n > 1, "{n}");
        for entry in &written {
            assert!(opened.sections.may_contain(entry.key_hash));
            assert!(
                find_in(&bytes, &opened, entry.key_hash).contains(entry),
                "{n}: {entry:?}"
            );
        }
    }
}

/// A filter in parts (a few distinct hashes each here, 2^22 in a store) finds every
/// key through its part, survives the whole-file check, and a part taken from another
/// file (checksum made valid) is refused by it.
#[test]
fn a_filter_in_parts_finds_every_key_and_is_checked_part_by_part() {
    let mut written = entries(5_000, 6);
    // Equal hashes never straddle two parts.
    for entry in written.iter_mut().skip(999).take(5) {
        entry.key_hash = written_hash(999);
    }
    written.sort();
    let bytes = encode_in_parts(3, &SEGMENTS, &written, 1_000, true);
    let opened = open(&bytes).unwrap();
    let decoded = decode_file(&bytes).unwrap();
    assert_eq!(decoded.entries, written);
    for entry in &written {
        assert!(opened.sections.may_contain(entry.key_hash));
        assert!(find_in(&bytes, &opened, entry.key_hash).contains(entry));
    }
    assert!(!opened.sections.may_contain(0), "below the first part");
    let other = encode_in_parts(3, &SEGMENTS, &entries(5_000, 7), 1_000, true);
    assert_eq!(other.len(), bytes.len());
    let header = opened.header;
    let start = header.sections_offset() as usize + SEGMENTS.len() * 24 + 8;
    let end = start + header.filter_len as usize;
    let mut spliced = bytes.clone();
    // The second part's fingerprints, from the other file (same sizes, other keys).
    let part = 4 + 16 + (header.filter_len as usize - 4) / 5;
    let len = 200;
    spliced[start + part..start + part + len]
        .copy_from_slice(&other[start + part..start + part + len]);
    let sum = checksum(&spliced[start..end]);
    spliced[end..end + 8].copy_from_slice(&sum.to_le_bytes());
    assert!(open(&spliced).is_ok(), "the section still decodes");
    assert_eq!(
        decode_file(&spliced).unwrap_err(),
        ColdError::Invalid("cold index filter is not its entries' filter")
    );
}

fn written_hash(i: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(&i.to_le_bytes(), 6)
}

#[test]
fn equal_hashes_across_a_page_boundary_are_all_found() {
    // 300 entries of one hash between others: they span pages 0 and 1 (and the
    // fence of page 1 equals the hash).
    let mut written = entries(600, 2);
    for (i, entry) in written.iter_mut().enumerate().skip(100).take(300) {
        entry.key_hash = 1 << 40;
        entry.field = i as u32;
    }
    written.sort();
    let bytes = encode(1, &SEGMENTS, &written, true);
    let opened = open(&bytes).unwrap();
    let found = find_in(&bytes, &opened, 1 << 40);
    assert_eq!(found.len(), 300);
    assert!(found.iter().all(|e| e.key_hash == 1 << 40));
    assert_eq!(pages_for(&opened.sections.fences, 1 << 40), 0..2);
    assert_eq!(pages_for(&opened.sections.fences, 0), 0..0);
}

#[test]
fn every_flipped_bit_of_the_header_and_sections_is_refused() {
    let bytes = encode(3, &SEGMENTS, &entries(700, 3), true);
    let header = decode_header(&bytes).unwrap();
    let sections_at = header.sections_offset() as usize;
    let covered = (0..HEADER_LEN).chain(sections_at..bytes.len());
    for at in covered {
        for bit in [0, 3, 7] {
            let mut damaged = bytes.clone();
            damaged[at] ^= 1 << bit;
            assert!(
                open(&damaged).is_err(),
                "byte {at} bit {bit} went unnoticed"
            );
        }
    }
}

#[test]
fn every_flipped_bit_of_a_page_is_refused_when_the_page_is_read() {
    let bytes = encode(3, &SEGMENTS, &entries(300, 4), true);
    let opened = open(&bytes).unwrap();
    for page in 0..opened.header.page_count {
        let start = opened.header.page_offset(page) as usize;
        for at in (start..start + PAGE_LEN).step_by(7) {
            let mut damaged = bytes.clone();
            damaged[at] ^= 0x10;
            let mut out = Vec::new();
            let result = decode_page(
                &opened.header,
                &opened.sections,
                page,
                &damaged[start..],
                &mut out,
            );
            assert!(result.is_err(), "page {page} byte {at} went unnoticed");
            assert!(out.is_empty());
        }
    }
}

#[test]
fn truncations_and_extensions_are_refused() {
    let bytes = encode(3, &SEGMENTS, &entries(300, 5), true);
    for len in [
        0,
        10,
        HEADER_LEN,
        PAGE_LEN,
        bytes.len() - 8,
        bytes.len() - 1,
    ] {
        assert!(open(&bytes[..len]).is_err(), "{len}");
    }
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(open(&longer).is_err());
    assert!(decode_file(&longer).is_err());
    let mut padded = bytes.clone();
    padded[HEADER_LEN + 1] = 1;
    assert!(decode_file(&padded).is_err());
    assert!(decode_file(&bytes).is_ok());
}

#[test]
fn a_filter_with_a_valid_checksum_that_is_not_the_entries_is_refused_by_a_whole_decode() {
    let written = entries(2_000, 7);
    let mut bytes = encode(3, &SEGMENTS, &written, true);
    let header = decode_header(&bytes).unwrap();
    // The filter section follows the segment table and its checksum.
    let start = header.sections_offset() as usize + SEGMENTS.len() * SEGMENT_LEN + 8;
    let end = start + header.filter_len as usize;
    bytes[end - 1] ^= 0x5a;
    let sum = checksum(&bytes[start..end]);
    bytes[end..end + 8].copy_from_slice(&sum.to_le_bytes());
    // The open path trusts the checksum; the whole decode (verify) does not.
    assert!(open(&bytes).is_ok());
    assert_eq!(
        decode_file(&bytes).unwrap_err(),
        ColdError::Invalid("cold index filter is not its entries' filter")
    );
}

#[test]
fn a_page_with_a_checksum_that_matches_but_wrong_contents_is_refused() {
    let written = entries(600, 6);
    let bytes = encode(3, &SEGMENTS, &written, true);
    let opened = open(&bytes).unwrap();
    type Damage = fn(&mut [ColdEntry]);
    let cases: [(&str, Damage); 3] = [
        ("unsorted", |e| e.swap(3, 4)),
        ("off its fence", |e| e[0].key_hash += 1),
        ("no such segment", |e| e[5].segment = 3),
    ];
    for (what, damage) in cases {
        let mut page: Vec<ColdEntry> = written[..PAGE_ENTRIES].to_vec();
        damage(&mut page);
        let encoded = encode_page(&page);
        let mut out = Vec::new();
        assert!(
            decode_page(&opened.header, &opened.sections, 0, &encoded, &mut out).is_err(),
            "{what}"
        );
    }
    // A short page where a full one belongs.
    let encoded = encode_page(&written[..PAGE_ENTRIES - 1]);
    let mut out = Vec::new();
    assert!(decode_page(&opened.header, &opened.sections, 0, &encoded, &mut out).is_err());
}

/// `find_in_page` over every page `pages_for` names.
fn find_fast(bytes: &[u8], opened: &Opened, key_hash: u64) -> Result<Vec<ColdEntry>, ColdError> {
    let mut found = Vec::new();
    for page in pages_for(&opened.sections.fences, key_hash) {
        let at = opened.header.page_offset(page) as usize;
        let mut in_page = Vec::new();
        find_in_page(
            &opened.header,
            &opened.sections,
            page,
            &bytes[at..at + PAGE_LEN],
            key_hash,
            &mut in_page,
        )?;
        for (i, entry) in in_page {
            assert_eq!(
                read_u64(&bytes[at..], i * ENTRY_LEN),
                key_hash,
                "position {i} is not the entry's"
            );
            found.push(entry);
        }
    }
    Ok(found)
}

#[test]
fn the_in_place_page_search_finds_what_the_decoding_find_finds() {
    let mut written = entries(2_000, 3);
    for (i, entry) in written.iter_mut().enumerate().skip(500).take(300) {
        entry.key_hash = 1 << 41;
        entry.field = i as u32;
    }
    written.sort();
    let bytes = encode(1, &SEGMENTS, &written, true);
    let opened = open(&bytes).unwrap();
    let mut probes: Vec<u64> = written.iter().map(|e| e.key_hash).collect();
    probes.extend((0..2_000u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
    probes.extend([0, u64::MAX, 1 << 41]);
    for hash in probes {
        let mut fast = find_fast(&bytes, &opened, hash).unwrap();
        let mut slow: Vec<ColdEntry> = pages_for(&opened.sections.fences, hash)
            .flat_map(|page| {
                let at = opened.header.page_offset(page) as usize;
                let mut out = Vec::new();
                decode_page(
                    &opened.header,
                    &opened.sections,
                    page,
                    &bytes[at..at + PAGE_LEN],
                    &mut out,
                )
                .unwrap();
                out.into_iter().filter(|e| e.key_hash == hash)
            })
            .collect();
        fast.sort();
        slow.sort();
        assert_eq!(fast, slow, "{hash:#x}");
    }
    assert_eq!(find_fast(&bytes, &opened, 1 << 41).unwrap().len(), 300);
}

#[test]
fn the_in_place_page_search_refuses_a_damaged_page() {
    let written = entries(600, 4);
    let bytes = encode(1, &SEGMENTS, &written, true);
    let opened = open(&bytes).unwrap();
    let target = written[10].key_hash;
    for byte in [0, 7, 100, 4079, 4080, 4090] {
        let mut damaged = bytes.clone();
        damaged[PAGE_LEN + byte] ^= 0x10;
        assert!(find_fast(&damaged, &opened, target).is_err(), "byte {byte}");
    }
}
