//! The `NAMESPACES` file: the durable map from namespace name to the `u32` id that
//! records carry.
//!
//! ```text
//! file header (16 bytes)
//! 0      8    magic         b"IDEMNSP\0"
//! 8      4    version       1
//! 12     4    reserved      zero
//!
//! entry (9 + name_len bytes), appended once per namespace
//! 0      4    checksum      low 32 bits of xxh3-64 over bytes 4..entry_len
//! 4      4    namespace_id  0, 1, 2, ... in order
//! 8      1    name_len      1..=64
//! 9      name_len           the name, UTF-8
//! ```

use super::{checksum32, read_u32};
use crate::limits;

pub(crate) const MAGIC: [u8; 8] = *b"IDEMNSP\0";
pub(crate) const VERSION: u32 = 1;
pub(crate) const HEADER_LEN: usize = 16;
const ENTRY_FIXED_LEN: usize = 9;

pub(crate) fn encode_header() -> [u8; HEADER_LEN] {
    let mut out = [0u8; HEADER_LEN];
    out[..8].copy_from_slice(&MAGIC);
    out[8..12].copy_from_slice(&VERSION.to_le_bytes());
    out
}

pub(crate) fn encode_entry(namespace_id: u32, name: &str) -> Vec<u8> {
    debug_assert!(!name.is_empty() && name.len() <= limits::NAMESPACE_LEN_MAX);
    let mut out = vec![0u8; ENTRY_FIXED_LEN + name.len()];
    out[4..8].copy_from_slice(&namespace_id.to_le_bytes());
    out[8] = name.len() as u8;
    out[ENTRY_FIXED_LEN..].copy_from_slice(name.as_bytes());
    let checksum = checksum32(&out[4..]);
    out[..4].copy_from_slice(&checksum.to_le_bytes());
    out
}

/// What a namespace file holds.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Decoded {
    /// Names in id order: `names[i]` has id `i`.
    pub names: Vec<String>,
    /// Length of the valid prefix; bytes after it are a torn tail to cut.
    pub valid_len: usize,
}

/// Decodes a namespace file. Never panics. An error means the header is damaged or
/// an entry before the end is damaged (not a torn tail): the caller reports it.
pub(crate) fn decode(bytes: &[u8]) -> Result<Decoded, (usize, String)> {
    if bytes.len() < HEADER_LEN {
        // A crash while creating the file leaves it short; nothing was acknowledged.
        return Ok(Decoded::default());
    }
    if bytes[..8] != MAGIC {
        return Err((0, "not an idemstore namespace file (bad magic)".to_string()));
    }
    let version = read_u32(bytes, 8);
    if version != VERSION {
        return Err((
            8,
            format!("namespace file version {version} is not supported"),
        ));
    }
    let mut names = Vec::new();
    let mut at = HEADER_LEN;
    while at < bytes.len() {
        let rest = &bytes[at..];
        if rest.len() < ENTRY_FIXED_LEN {
            break;
        }
        let name_len = usize::from(rest[8]);
        let entry_len = ENTRY_FIXED_LEN + name_len;
        if rest.len() < entry_len {
            // Running past the end: a torn last entry, unless a valid entry follows
            // (then its length byte is damaged, and cutting here would drop the rest).
            if entry_starts_after(bytes, at + 1) {
                return Err((at, "namespace entry length is damaged".to_string()));
            }
            break;
        }
        let valid = name_len > 0
            && name_len <= limits::NAMESPACE_LEN_MAX
            && read_u32(rest, 0) == checksum32(&rest[4..entry_len])
            && read_u32(rest, 4) as usize == names.len();
        let name = if valid {
            std::str::from_utf8(&rest[ENTRY_FIXED_LEN..entry_len]).ok()
        } else {
            None
        };
        match name {
            Some(name) => names.push(name.to_string()),
            None if rest.iter().all(|&b| b == 0) || !entry_starts_after(bytes, at + 1) => {
                break;
            }
            None => return Err((at, "namespace entry failed its checksum".to_string())),
        }
        at += entry_len;
    }
    Ok(Decoded {
        names,
        valid_len: at.min(bytes.len()),
    })
}

/// Whether a checksummed entry starts anywhere at or after `from`. A damaged entry
/// with none after it is a torn tail (a crash while the last namespace was added, its
/// length byte possibly torn too); one with a valid entry after it is corruption.
fn entry_starts_after(bytes: &[u8], from: usize) -> bool {
    (from..bytes.len()).any(|at| {
        let rest = &bytes[at..];
        if rest.len() < ENTRY_FIXED_LEN {
            return false;
        }
        let name_len = usize::from(rest[8]);
        let entry_len = ENTRY_FIXED_LEN + name_len;
        name_len > 0
            && name_len <= limits::NAMESPACE_LEN_MAX
            && rest.len() >= entry_len
            && read_u32(rest, 0) == checksum32(&rest[4..entry_len])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_a_torn_tail_is_cut() {
        let mut file = encode_header().to_vec();
        file.extend(encode_entry(0, "inventory"));
        file.extend(encode_entry(1, "payments"));
        let full = file.len();
        let decoded = decode(&file).unwrap();
        assert_eq!(decoded.names, vec!["inventory", "payments"]);
        assert_eq!(decoded.valid_len, full);
        for cut in HEADER_LEN..full {
            let decoded = decode(&file[..cut]).unwrap();
            assert!(decoded.names.len() < 2, "cut at {cut}");
            assert_eq!(
                decoded.names.first().map(String::as_str),
                (cut >= HEADER_LEN + 18).then_some("inventory")
            );
        }
    }

    #[test]
    fn damage_before_the_end_is_an_error() {
        let mut file = encode_header().to_vec();
        file.extend(encode_entry(0, "inventory"));
        file.extend(encode_entry(1, "payments"));
        file[HEADER_LEN + 10] ^= 1;
        assert_eq!(decode(&file).unwrap_err().0, HEADER_LEN);
    }
}
