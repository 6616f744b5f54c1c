//! Fuzz harness (a): the record decoder and the segment scan, shared by
//! `fuzz/fuzz_targets/record_decoder.rs` and `tests/fuzz_regressions.rs`.
//!
//! Checks, for any bytes: nothing panics; a decoded record lies inside the input and
//! re-encodes to exactly the bytes it was decoded from; a scan reports records in
//! order, without overlap, each of which decodes on its own, and a valid end inside
//! the buffer; the segment header and NAMESPACES decoders either refuse the bytes or
//! accept bytes that re-encode to themselves.

use idemstore::fuzzing;

pub fn run(data: &[u8]) {
    if let Ok(record) = fuzzing::decode_record(data) {
        assert!(record.len <= data.len());
        assert!(!record.id.is_empty());
        assert_eq!(record.reencoded, &data[..record.len], "re-encoding differs");
    }

    for start in [0, fuzzing::SEGMENT_HEADER_LEN] {
        let scan = fuzzing::scan_segment(data, start);
        let mut end = start;
        for &(offset, len) in &scan.records {
            assert!(offset >= end, "records overlap or go backwards");
            let record = fuzzing::decode_record(&data[offset..]).expect("scanned record decodes");
            assert_eq!(record.len, len);
            assert_eq!(record.reencoded, &data[offset..offset + len]);
            end = offset + len;
        }
        if start <= data.len() {
            assert_eq!(
                scan.valid_end, end,
                "valid_end is the end of the last record"
            );
        }
        assert!(scan.valid_end <= data.len().max(start));
        for &offset in &scan.corrupt_offsets {
            assert!(offset < data.len());
        }
    }

    if let Ok(header) = fuzzing::decode_segment_header(data) {
        let encoded = fuzzing::encode_segment_header(header);
        assert_eq!(&encoded[..], &data[..fuzzing::SEGMENT_HEADER_LEN]);
    }

    match fuzzing::decode_namespace_file(data) {
        Ok((names, valid_len)) => {
            assert!(valid_len <= data.len());
            if valid_len >= 16 {
                let names: Vec<&str> = names.iter().map(String::as_str).collect();
                let encoded = fuzzing::encode_namespace_file(&names);
                // Bytes 12..16 are reserved and not checked by the decoder.
                assert_eq!(&encoded[16..], &data[16..valid_len]);
                assert_eq!(&encoded[..12], &data[..12]);
            } else {
                assert!(names.is_empty());
            }
        }
        Err((offset, reason)) => {
            assert!(offset < data.len());
            assert!(!reason.is_empty());
        }
    }
}
