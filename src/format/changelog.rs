//! Changelog messages: what a partition's owner ships to the replicated engine
//! (`docs/FORMAT.md`, "Changelog messages"). One message carries many records of one
//! namespace and one partition, each in the store's own record encoding (checked by
//! its own checksum, partition-scoped: it carries its partition and source offset)
//! with the bucket deadline it is remembered until, or announces a new
//! owner of the partition (the fence). A pure codec: the decoder returns an error for
//! malformed input and never panics, whatever the bytes.
//!
//! ```text
//! offset size field
//! 0      4    magic          "IDCL"
//! 4      1    version        2 (1 carried a source offset where 2 has the deadline;
//!                            no store ever shipped it)
//! 5      1    kind           1 records, 2 owner (the fence a new owner writes)
//! 6      2    namespace_len  1..=255
//! 8      4    partition      the partition the records belong to
//! 12     4    count          records that follow (0 for an owner message)
//! 16     8    owner          the writer's owner token, never 0
//! 24     8    batch          the writer's message counter: 1 for its owner message,
//!                            then 2, 3, … per message it writes
//! 32     n    namespace      the namespace name (UTF-8)
//! 32+n        records        count × { u64 deadline_ms, record (a scoped kind, of this
//!                            partition) }
//! end-8  8    checksum       xxh3-64 over every byte before it
//! ```

use super::{read_u16, read_u32, read_u64, record};

/// The first four bytes of every changelog message.
pub(crate) const MAGIC: [u8; 4] = *b"IDCL";
/// The version this code writes and reads.
pub(crate) const VERSION: u8 = 2;
const KIND_RECORDS: u8 = 1;
const KIND_OWNER: u8 = 2;
/// Bytes before the namespace name.
pub(crate) const HEADER_LEN: usize = 32;
const CHECKSUM_LEN: usize = 8;
/// The longest namespace name a message can carry (the store's limit is lower).
pub(crate) const NAMESPACE_LEN_MAX: usize = 255;

/// What a message says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Records of the partition.
    Records,
    /// A new owner takes the partition over: every message after it from another
    /// owner is a zombie's.
    Owner,
}

/// The fields of a message's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MessageHeader<'a> {
    pub kind: Kind,
    pub namespace: &'a str,
    pub partition: u32,
    pub owner: u64,
    pub batch: u64,
}

/// Why bytes are not a changelog message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MessageError {
    /// Too short, or a length inside points past the end.
    Truncated,
    /// Not a changelog message, or one this version cannot read.
    Invalid(&'static str),
    /// The message's checksum does not match its bytes.
    Checksum,
    /// Record `index` of the message does not decode (its own checksum, or its fields).
    Record(usize),
}

/// Encodes a message. `records` are `(bucket deadline in unix ms, record bytes)`; the
/// record bytes must be partition-scoped records of `header.partition` encoded by
/// `format::record` (the encoder copies them as they are).
pub(crate) fn encode(header: &MessageHeader<'_>, records: &[(u64, &[u8])]) -> Vec<u8> {
    debug_assert!(!header.namespace.is_empty() && header.namespace.len() <= NAMESPACE_LEN_MAX);
    debug_assert!(header.owner != 0);
    debug_assert!(header.kind == Kind::Records || records.is_empty());
    let body: usize = records.iter().map(|(_, r)| 8 + r.len()).sum();
    let mut out = Vec::with_capacity(HEADER_LEN + header.namespace.len() + body + CHECKSUM_LEN);
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(match header.kind {
        Kind::Records => KIND_RECORDS,
        Kind::Owner => KIND_OWNER,
    });
    out.extend_from_slice(&(header.namespace.len() as u16).to_le_bytes());
    out.extend_from_slice(&header.partition.to_le_bytes());
    out.extend_from_slice(&(records.len() as u32).to_le_bytes());
    out.extend_from_slice(&header.owner.to_le_bytes());
    out.extend_from_slice(&header.batch.to_le_bytes());
    out.extend_from_slice(header.namespace.as_bytes());
    for (deadline, bytes) in records {
        out.extend_from_slice(&deadline.to_le_bytes());
        out.extend_from_slice(bytes);
    }
    let checksum = xxhash_rust::xxh3::xxh3_64(&out);
    out.extend_from_slice(&checksum.to_le_bytes());
    out
}

/// A decoded message: its header and its records, borrowed from the message bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Message<'a> {
    pub header: MessageHeader<'a>,
    /// `(bucket deadline in unix ms, record)` in the order they were written.
    pub records: Vec<(u64, record::StoredRecord<'a>)>,
}

/// Decodes and verifies a whole message: the checksum over it, then every record's
/// own checksum and fields. Allocates at most one entry per record actually present
/// (the count field is checked against the bytes, not trusted).
pub(crate) fn decode(bytes: &[u8]) -> Result<Message<'_>, MessageError> {
    if bytes.len() < HEADER_LEN + CHECKSUM_LEN {
        return Err(MessageError::Truncated);
    }
    if bytes[..4] != MAGIC {
        return Err(MessageError::Invalid("not a changelog message (magic)"));
    }
    if bytes[4] != VERSION {
        return Err(MessageError::Invalid(
            "unsupported changelog message version",
        ));
    }
    let (covered, tail) = bytes.split_at(bytes.len() - CHECKSUM_LEN);
    if read_u64(tail, 0) != xxhash_rust::xxh3::xxh3_64(covered) {
        return Err(MessageError::Checksum);
    }
    let kind = match bytes[5] {
        KIND_RECORDS => Kind::Records,
        KIND_OWNER => Kind::Owner,
        _ => return Err(MessageError::Invalid("unknown changelog message kind")),
    };
    let namespace_len = usize::from(read_u16(bytes, 6));
    if namespace_len == 0 || namespace_len > NAMESPACE_LEN_MAX {
        return Err(MessageError::Invalid("namespace length out of range"));
    }
    let partition = read_u32(bytes, 8);
    let count = read_u32(bytes, 12) as usize;
    let owner = read_u64(bytes, 16);
    if owner == 0 {
        return Err(MessageError::Invalid("owner token 0"));
    }
    let batch = read_u64(bytes, 24);
    let names_end = HEADER_LEN + namespace_len;
    if covered.len() < names_end {
        return Err(MessageError::Truncated);
    }
    let namespace = std::str::from_utf8(&covered[HEADER_LEN..names_end])
        .map_err(|_| MessageError::Invalid("namespace name is not UTF-8"))?;
    if kind == Kind::Owner && count != 0 {
        return Err(MessageError::Invalid("an owner message carries no records"));
    }
    let mut rest = &covered[names_end..];
    // Each record takes at least its deadline and a record header: a count the bytes
    // cannot hold is refused before anything is reserved.
    if count > rest.len() / (8 + record::HEADER_LEN) {
        return Err(MessageError::Truncated);
    }
    let mut records = Vec::with_capacity(count);
    for index in 0..count {
        if rest.len() < 8 {
            return Err(MessageError::Truncated);
        }
        let deadline = read_u64(rest, 0);
        let (stored, len) = record::decode(&rest[8..]).map_err(|_| MessageError::Record(index))?;
        if stored.placement.partition != Some(partition) {
            return Err(MessageError::Record(index));
        }
        records.push((deadline, stored));
        rest = &rest[8 + len..];
    }
    if !rest.is_empty() {
        return Err(MessageError::Invalid("bytes after the last record"));
    }
    Ok(Message {
        header: MessageHeader {
            kind,
            namespace,
            partition,
            owner,
            batch,
        },
        records,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::addr::Lsn;
    use crate::format::record::{ClaimFields, Placement, State, StoredRecord};

    fn at(offset: Option<u64>) -> Placement {
        Placement {
            partition: Some(12),
            offset,
        }
    }

    fn mark(id: &[u8], lsn: u64) -> Vec<u8> {
        StoredRecord {
            state: State::Seen,
            namespace_id: 3,
            placement: at(Some(lsn * 10)),
            lsn: Lsn(lsn),
            first_seen_ms: 1_700_000_000_000,
            id,
            claim: ClaimFields::default(),
            result: None,
        }
        .encode()
    }

    fn completed(id: &[u8], lsn: u64) -> Vec<u8> {
        StoredRecord {
            state: State::Completed,
            namespace_id: 3,
            placement: at(None),
            lsn: Lsn(lsn),
            first_seen_ms: 1_700_000_000_000,
            id,
            claim: ClaimFields {
                attempts: 2,
                lease_until_ms: 0,
                completed_ms: 1_700_000_000_500,
                payload_fp: Some(7),
            },
            result: Some(b"receipt"),
        }
        .encode()
    }

    fn header(kind: Kind) -> MessageHeader<'static> {
        MessageHeader {
            kind,
            namespace: "inventory",
            partition: 12,
            owner: 0xfeed,
            batch: 5,
        }
    }

    #[test]
    fn records_round_trip_with_their_deadlines_and_offsets() {
        let (a, b) = (mark(b"order-1", 10), completed(b"order-2", 11));
        let bytes = encode(&header(Kind::Records), &[(41, &a), (42, &b)]);
        let message = decode(&bytes).unwrap();
        assert_eq!(message.header, header(Kind::Records));
        assert_eq!(message.records.len(), 2);
        assert_eq!(message.records[0].0, 41);
        assert_eq!(message.records[0].1.id, b"order-1");
        assert_eq!(message.records[0].1.placement, at(Some(100)));
        assert_eq!(message.records[1].0, 42);
        assert_eq!(message.records[1].1.result, Some(&b"receipt"[..]));
        assert_eq!(message.records[1].1.encode(), b);
    }

    #[test]
    fn an_owner_message_round_trips_and_carries_no_records() {
        let bytes = encode(&header(Kind::Owner), &[]);
        assert_eq!(decode(&bytes).unwrap().header, header(Kind::Owner));
        assert_eq!(bytes.len(), HEADER_LEN + "inventory".len() + CHECKSUM_LEN);
    }

    #[test]
    fn every_single_bit_flip_and_every_truncation_is_refused() {
        let (a, b) = (mark(b"order-1", 10), completed(b"order-2", 11));
        let bytes = encode(&header(Kind::Records), &[(41, &a), (42, &b)]);
        for bit in 0..bytes.len() * 8 {
            let mut damaged = bytes.clone();
            damaged[bit / 8] ^= 1 << (bit % 8);
            assert!(decode(&damaged).is_err(), "bit {bit} flipped was accepted");
        }
        for len in 0..bytes.len() {
            assert!(decode(&bytes[..len]).is_err(), "cut at {len} was accepted");
        }
    }

    #[test]
    fn a_damaged_record_under_a_valid_message_checksum_is_named_by_index() {
        let (a, b) = (mark(b"order-1", 10), mark(b"order-2", 11));
        let mut bytes = encode(&header(Kind::Records), &[(1, &a), (1, &b)]);
        // Flip a byte of the second record's id, then make the message checksum
        // match again: only the record's own checksum can tell.
        let at = HEADER_LEN + "inventory".len() + 8 + a.len() + 8 + record::HEADER_LEN + 12;
        bytes[at] ^= 0x20;
        let end = bytes.len() - CHECKSUM_LEN;
        let checksum = xxhash_rust::xxh3::xxh3_64(&bytes[..end]);
        bytes[end..].copy_from_slice(&checksum.to_le_bytes());
        assert_eq!(decode(&bytes), Err(MessageError::Record(1)));
    }

    #[test]
    fn a_count_larger_than_the_bytes_is_refused_before_allocating() {
        let a = mark(b"order-1", 10);
        let mut bytes = encode(&header(Kind::Records), &[(1, &a)]);
        bytes[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        let end = bytes.len() - CHECKSUM_LEN;
        let checksum = xxhash_rust::xxh3::xxh3_64(&bytes[..end]);
        bytes[end..].copy_from_slice(&checksum.to_le_bytes());
        assert_eq!(decode(&bytes), Err(MessageError::Truncated));
    }

    #[test]
    fn a_record_of_another_partition_or_unscoped_is_refused() {
        let good = mark(b"order-1", 10);
        let mut record = record::decode(&good).unwrap().0;
        record.placement.partition = Some(13);
        let other = record.encode();
        record.placement = Placement::UNSCOPED;
        let unscoped = record.encode();
        for bad in [other, unscoped] {
            let bytes = encode(&header(Kind::Records), &[(1, &bad)]);
            assert_eq!(decode(&bytes), Err(MessageError::Record(0)));
        }
    }
}
