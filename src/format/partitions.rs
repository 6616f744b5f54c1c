//! The `PARTITIONS` file (`docs/FORMAT.md`): the subject prefix the positions were
//! taken under, and per replicated partition the changelog position this store's
//! records are complete to, the owner token it last held and the highest source
//! offset marked, and whether its local records may hold some the changelog does not
//! (a re-ship is due at its next restore). Written whole (temp file, fsync, rename,
//! directory fsync) when a partition is restored or released and at close; read at
//! open, so that a restore after a restart reads the changelog from where this store
//! is (a warm restore) instead of from the start.
//!
//! Layout, little-endian: `IDPT` magic, version u8 (3), 3 zero bytes, count u32,
//! prefix length u32 and the prefix's UTF-8 bytes (empty: never replicated), then
//! `count` entries of 40 bytes — namespace id u32, partition u32, position u64, token
//! u64, highest offset u64 (`u64::MAX`: none), flags u32 (bit 0: re-ship due), 4 zero
//! bytes — then xxh3-64 of everything before it. Versions 1 (32-byte entries, no
//! flags, every entry taken as due a re-ship: the safe side, a re-ship costs a scan,
//! never an answer) and 2 (no prefix) still read, their prefix unknown.

use xxhash_rust::xxh3::xxh3_64;

const MAGIC: [u8; 4] = *b"IDPT";
const VERSION: u8 = 3;
const HEADER_LEN: usize = 12;
const ENTRY_LEN: usize = 40;
const ENTRY_LEN_V1: usize = 32;
const FLAG_RESHIP: u32 = 1;

/// One partition's entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PartitionEntry {
    pub namespace_id: u32,
    pub partition: u32,
    pub position: u64,
    pub token: u64,
    pub highest_offset: Option<u64>,
    /// This store's live records of the partition may include some the changelog
    /// lacks (it stopped owning it with records unshipped, or crashed owning it).
    pub reship: bool,
}

/// What a `PARTITIONS` file holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Partitions {
    /// The replication subject prefix the positions and tokens belong to: empty if
    /// the store never replicated, `None` if the file predates version 3.
    pub prefix: Option<String>,
    pub entries: Vec<PartitionEntry>,
}

pub(crate) fn encode(prefix: &str, entries: &[PartitionEntry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + 4 + prefix.len() + entries.len() * ENTRY_LEN + 8);
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.extend_from_slice(&[0; 3]);
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    out.extend_from_slice(&(prefix.len() as u32).to_le_bytes());
    out.extend_from_slice(prefix.as_bytes());
    for e in entries {
        out.extend_from_slice(&e.namespace_id.to_le_bytes());
        out.extend_from_slice(&e.partition.to_le_bytes());
        out.extend_from_slice(&e.position.to_le_bytes());
        out.extend_from_slice(&e.token.to_le_bytes());
        out.extend_from_slice(&e.highest_offset.unwrap_or(u64::MAX).to_le_bytes());
        let flags = if e.reship { FLAG_RESHIP } else { 0 };
        out.extend_from_slice(&flags.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
    }
    let sum = xxh3_64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// The file's contents, or why the bytes are not a `PARTITIONS` file.
pub(crate) fn decode(bytes: &[u8]) -> Result<Partitions, String> {
    if bytes.len() < HEADER_LEN + 8 {
        return Err(format!("{} bytes, shorter than a header", bytes.len()));
    }
    if bytes[..4] != MAGIC {
        return Err("not a PARTITIONS file (bad magic)".into());
    }
    let version = bytes[4];
    let entry_len = match version {
        1 => ENTRY_LEN_V1,
        2 | VERSION => ENTRY_LEN,
        v => return Err(format!("version {v} (this build reads 1 to {VERSION})")),
    };
    let (body, sum) = bytes.split_at(bytes.len() - 8);
    if xxh3_64(body).to_le_bytes() != sum {
        return Err("checksum mismatch".into());
    }
    let u64_at = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().expect("8 bytes"));
    let u32_at = |at: usize| u32::from_le_bytes(body[at..at + 4].try_into().expect("4 bytes"));
    let count = u32_at(8) as usize;
    let (prefix, first) = if version == VERSION {
        if body.len() < HEADER_LEN + 4 {
            return Err("no room for the subject prefix's length".into());
        }
        let len = u32_at(HEADER_LEN) as usize;
        let end = (HEADER_LEN + 4)
            .checked_add(len)
            .filter(|&end| end <= body.len())
            .ok_or_else(|| format!("a subject prefix of {len} bytes overruns the file"))?;
        let prefix = std::str::from_utf8(&body[HEADER_LEN + 4..end])
            .map_err(|_| "the subject prefix is not UTF-8".to_string())?;
        (Some(prefix.to_string()), end)
    } else {
        (None, HEADER_LEN)
    };
    if Some(body.len() - first) != count.checked_mul(entry_len) {
        return Err(format!(
            "{count} entries do not fill {} bytes",
            body.len() - first
        ));
    }
    let entries = (0..count)
        .map(|i| {
            let at = first + i * entry_len;
            let highest = u64_at(at + 24);
            PartitionEntry {
                namespace_id: u32_at(at),
                partition: u32_at(at + 4),
                position: u64_at(at + 8),
                token: u64_at(at + 16),
                highest_offset: (highest != u64::MAX).then_some(highest),
                reship: entry_len == ENTRY_LEN_V1 || u32_at(at + 32) & FLAG_RESHIP != 0,
            }
        })
        .collect();
    Ok(Partitions { prefix, entries })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_any_damage_is_refused() {
        let entries = vec![
            PartitionEntry {
                namespace_id: 0,
                partition: 7,
                position: 1234,
                token: 0xfeed,
                highest_offset: Some(99),
                reship: true,
            },
            PartitionEntry {
                namespace_id: 3,
                partition: 0,
                position: 0,
                token: 0,
                highest_offset: None,
                reship: false,
            },
        ];
        let bytes = encode("idemstore.orders", &entries);
        assert_eq!(bytes.len(), HEADER_LEN + 4 + 16 + 2 * ENTRY_LEN + 8);
        assert_eq!(
            decode(&bytes).unwrap(),
            Partitions {
                prefix: Some("idemstore.orders".into()),
                entries: entries.clone()
            }
        );
        let empty = decode(&encode("", &[])).unwrap();
        assert_eq!(empty.prefix.as_deref(), Some(""));
        assert!(empty.entries.is_empty());
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(decode(&bad).is_err(), "a flip at byte {i} decoded");
        }
        assert!(decode(&bytes[..bytes.len() - 1]).is_err());
    }

    /// A pre-version-3 file (no prefix field) holding one entry.
    fn legacy_file(version: u8, entry: &[u8]) -> Vec<u8> {
        let mut file = Vec::new();
        file.extend_from_slice(&MAGIC);
        file.push(version);
        file.extend_from_slice(&[0; 3]);
        file.extend_from_slice(&1u32.to_le_bytes());
        file.extend_from_slice(entry);
        let sum = xxh3_64(&file);
        file.extend_from_slice(&sum.to_le_bytes());
        file
    }

    #[test]
    fn version_1_files_still_read_with_every_entry_due_a_reship() {
        // A version 1 file: the same header, 32-byte entries without flags.
        let mut entry = Vec::new();
        entry.extend_from_slice(&2u32.to_le_bytes());
        entry.extend_from_slice(&5u32.to_le_bytes());
        entry.extend_from_slice(&77u64.to_le_bytes());
        entry.extend_from_slice(&9u64.to_le_bytes());
        entry.extend_from_slice(&u64::MAX.to_le_bytes());
        let v1 = legacy_file(1, &entry);
        let read = decode(&v1).unwrap();
        assert_eq!(read.prefix, None);
        assert_eq!(
            read.entries,
            vec![PartitionEntry {
                namespace_id: 2,
                partition: 5,
                position: 77,
                token: 9,
                highest_offset: None,
                reship: true,
            }]
        );
        let mut v4 = v1.clone();
        v4[4] = 4;
        assert!(decode(&v4).unwrap_err().contains("version 4"));
    }

    #[test]
    fn version_2_files_still_read_their_flags_with_the_prefix_unknown() {
        let mut entry = Vec::new();
        entry.extend_from_slice(&4u32.to_le_bytes());
        entry.extend_from_slice(&1u32.to_le_bytes());
        entry.extend_from_slice(&12u64.to_le_bytes());
        entry.extend_from_slice(&3u64.to_le_bytes());
        entry.extend_from_slice(&40u64.to_le_bytes());
        entry.extend_from_slice(&[0; 8]); // flags 0, 4 zero bytes
        let v2 = legacy_file(2, &entry);
        let read = decode(&v2).unwrap();
        assert_eq!(read.prefix, None);
        assert_eq!(
            read.entries,
            vec![PartitionEntry {
                namespace_id: 4,
                partition: 1,
                position: 12,
                token: 3,
                highest_offset: Some(40),
                reship: false,
            }]
        );
    }
}
