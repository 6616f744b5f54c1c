//! Log records. Every state change of a key is one self-contained record; the newest
//! record of a key (highest `lsn`) is its state.
//!
//! ```text
//! offset size field
//! 0      4    checksum       low 32 bits of xxh3-64 over bytes 4..record_len
//! 4      1    kind           0xA1 mark, 0xA2 claim, 0xA3 tombstone (0 is never valid)
//! 5      1    status         0 for mark and tombstone; claim: 1 in progress,
//!                            2 released, 3 completed, 4 failed
//! 6      2    id_len         1..=65535
//! 8      4    namespace_id   from the NAMESPACES file
//! 12     4    body_len       0 for mark and tombstone; claim: 40 + result_len
//! 16     8    lsn            log sequence number, unique in a store and increasing per key (`addr::Lsn`)
//! 24     8    first_seen_ms  unix ms when the key was first seen in this retention
//! 32     id_len              the id bytes
//! 32+id  body_len            the claim body (below), if any
//!
//! partition-scoped kinds (format v2): 0xB1 mark, 0xB2 claim, 0xB3 tombstone, whose
//! 12-byte scope follows the fixed header and comes before the id
//! 32     4    partition      the partition the key is scoped to
//! 36     8    source_offset  the message's offset in its partition (u64::MAX: none)
//! 44     id_len              the id bytes, then the body as above
//!
//! claim body
//! 0      4    attempts       acquisitions so far (1 after the first begin)
//! 4      4    result_len     0..=1 MiB
//! 8      8    lease_until_ms 0 unless in progress
//! 16     8    completed_ms   0 unless completed
//! 24     8    payload_fp     xxh3-64 of the payload, if flag bit 1
//! 32     4    flags          bit 0: has result; bit 1: has payload fingerprint
//! 36     4    reserved       zero
//! 40     result_len          the stored result
//! ```

use super::{checksum32, read_u16, read_u32, read_u64};
use crate::addr::Lsn;
use crate::limits;

const CHECKSUM_OFFSET: usize = 0;
const KIND_OFFSET: usize = CHECKSUM_OFFSET + 4;
const STATUS_OFFSET: usize = KIND_OFFSET + 1;
const ID_LEN_OFFSET: usize = STATUS_OFFSET + 1;
const NAMESPACE_ID_OFFSET: usize = ID_LEN_OFFSET + 2;
const BODY_LEN_OFFSET: usize = NAMESPACE_ID_OFFSET + 4;
const LSN_OFFSET: usize = BODY_LEN_OFFSET + 4;
const FIRST_SEEN_OFFSET: usize = LSN_OFFSET + 8;
/// Length of the fixed record header; the id follows.
pub(crate) const HEADER_LEN: usize = FIRST_SEEN_OFFSET + 8;

const ATTEMPTS_OFFSET: usize = 0;
const RESULT_LEN_OFFSET: usize = ATTEMPTS_OFFSET + 4;
const LEASE_UNTIL_OFFSET: usize = RESULT_LEN_OFFSET + 4;
const COMPLETED_OFFSET: usize = LEASE_UNTIL_OFFSET + 8;
const PAYLOAD_FP_OFFSET: usize = COMPLETED_OFFSET + 8;
const FLAGS_OFFSET: usize = PAYLOAD_FP_OFFSET + 8;
const BODY_RESERVED_OFFSET: usize = FLAGS_OFFSET + 4;
/// Length of the fixed claim body; the result follows.
pub(crate) const CLAIM_BODY_LEN: usize = BODY_RESERVED_OFFSET + 4;

const FLAG_HAS_RESULT: u32 = 1;
const FLAG_HAS_PAYLOAD: u32 = 2;

/// The longest record this version can write or read.
pub(crate) const RECORD_LEN_MAX: usize =
    HEADER_LEN + SCOPE_LEN + limits::KEY_LEN_MAX + CLAIM_BODY_LEN + limits::RESULT_LEN_MAX;

const _: () = assert!(HEADER_LEN == 32);
const _: () = assert!(CLAIM_BODY_LEN == 40);
const _: () = assert!(RECORD_LEN_MAX < limits::SEGMENT_SIZE_BYTES_MIN as usize * 32);

pub(crate) const KIND_MARK: u8 = 0xA1;
pub(crate) const KIND_CLAIM: u8 = 0xA2;
pub(crate) const KIND_TOMBSTONE: u8 = 0xA3;
/// Added to a kind for its partition-scoped form (format v2).
const KIND_SCOPED: u8 = 0x10;
/// Length of the scope of a partition-scoped record: partition, source offset.
pub(crate) const SCOPE_LEN: usize = 12;
/// A scoped record's source offset when it has none.
const NO_OFFSET: u64 = u64::MAX;

/// Whether `byte` is a record kind (plain or partition-scoped): the resync of a scan
/// over damage looks for one before it tries to decode.
pub(crate) fn is_kind(byte: u8) -> bool {
    matches!(byte, 0xA1..=0xA3 | 0xB1..=0xB3)
}

/// Where a key belongs: unscoped (format v1 records), or a partition, with the source
/// offset of the message the record was written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub(crate) struct Placement {
    pub partition: Option<u32>,
    /// Meaningful only with a partition (an unscoped record has no room for it).
    pub offset: Option<u64>,
}

impl Placement {
    pub(crate) const UNSCOPED: Placement = Placement {
        partition: None,
        offset: None,
    };

    fn scope_len(&self) -> usize {
        if self.partition.is_some() {
            SCOPE_LEN
        } else {
            0
        }
    }
}

/// The state a record gives its key: the public `Status` vocabulary, plus the
/// tombstone of a removed key (`lifecycle::status_of` maps the two).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    /// `check_and_set` saw the key (a mark record).
    Seen,
    InProgress,
    Released,
    Completed,
    Failed,
    /// `remove` forgot the key.
    Tombstone,
}

impl State {
    /// Every state, in the order `StateCounts` counts them (tested there).
    pub(crate) const ALL: [State; 6] = [
        State::Seen,
        State::InProgress,
        State::Released,
        State::Completed,
        State::Failed,
        State::Tombstone,
    ];
}

impl State {
    fn kind_and_status(self) -> (u8, u8) {
        match self {
            State::Seen => (KIND_MARK, 0),
            State::InProgress => (KIND_CLAIM, 1),
            State::Released => (KIND_CLAIM, 2),
            State::Completed => (KIND_CLAIM, 3),
            State::Failed => (KIND_CLAIM, 4),
            State::Tombstone => (KIND_TOMBSTONE, 0),
        }
    }

    /// The state and whether the record is partition-scoped.
    fn from_kind_and_status(kind: u8, status: u8) -> Option<(State, bool)> {
        let scoped = matches!(kind, 0xB1..=0xB3);
        let kind = if scoped { kind - KIND_SCOPED } else { kind };
        Some((Self::from_plain_kind(kind, status)?, scoped))
    }

    fn from_plain_kind(kind: u8, status: u8) -> Option<State> {
        Some(match (kind, status) {
            (KIND_MARK, 0) => State::Seen,
            (KIND_CLAIM, 1) => State::InProgress,
            (KIND_CLAIM, 2) => State::Released,
            (KIND_CLAIM, 3) => State::Completed,
            (KIND_CLAIM, 4) => State::Failed,
            (KIND_TOMBSTONE, 0) => State::Tombstone,
            _ => return None,
        })
    }

    pub(crate) fn has_claim_body(self) -> bool {
        matches!(
            self,
            State::InProgress | State::Released | State::Completed | State::Failed
        )
    }
}

/// The claim fields of a record (zero for marks and tombstones).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct ClaimFields {
    pub attempts: u32,
    pub lease_until_ms: u64,
    pub completed_ms: u64,
    pub payload_fp: Option<u64>,
}

/// One record, borrowed from the bytes it was decoded from (or that it will encode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StoredRecord<'a> {
    pub state: State,
    pub namespace_id: u32,
    /// The partition scope and source offset (format v2 kinds), or none.
    pub placement: Placement,
    pub lsn: Lsn,
    pub first_seen_ms: u64,
    pub id: &'a [u8],
    pub claim: ClaimFields,
    pub result: Option<&'a [u8]>,
}

/// Why bytes are not a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DecodeError {
    /// The bytes end inside the record (a torn tail, or a length field that is damaged).
    Truncated,
    /// The bytes are not a valid record.
    Invalid(&'static str),
}

impl StoredRecord<'_> {
    /// The encoded length of this record.
    pub(crate) fn encoded_len(&self) -> usize {
        HEADER_LEN + self.placement.scope_len() + self.id.len() + self.body_len()
    }

    fn body_len(&self) -> usize {
        if self.state.has_claim_body() {
            CLAIM_BODY_LEN + self.result.map_or(0, <[u8]>::len)
        } else {
            0
        }
    }

    /// Writes the record into `out`, which must be exactly `encoded_len()` bytes.
    pub(crate) fn encode_into(&self, out: &mut [u8]) {
        debug_assert_eq!(out.len(), self.encoded_len());
        debug_assert!(!self.id.is_empty() && self.id.len() <= limits::KEY_LEN_MAX);
        debug_assert!(self.result.is_none() || self.state.has_claim_body());
        let (kind, status) = self.state.kind_and_status();
        let kind = if self.placement.partition.is_some() {
            kind + KIND_SCOPED
        } else {
            kind
        };
        let body_len = self.body_len();
        out[KIND_OFFSET] = kind;
        out[STATUS_OFFSET] = status;
        out[ID_LEN_OFFSET..NAMESPACE_ID_OFFSET]
            .copy_from_slice(&(self.id.len() as u16).to_le_bytes());
        out[NAMESPACE_ID_OFFSET..BODY_LEN_OFFSET].copy_from_slice(&self.namespace_id.to_le_bytes());
        out[BODY_LEN_OFFSET..LSN_OFFSET].copy_from_slice(&(body_len as u32).to_le_bytes());
        out[LSN_OFFSET..FIRST_SEEN_OFFSET].copy_from_slice(&self.lsn.0.to_le_bytes());
        out[FIRST_SEEN_OFFSET..HEADER_LEN].copy_from_slice(&self.first_seen_ms.to_le_bytes());
        let id_start = HEADER_LEN + self.placement.scope_len();
        if let Some(partition) = self.placement.partition {
            out[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&partition.to_le_bytes());
            out[HEADER_LEN + 4..id_start]
                .copy_from_slice(&self.placement.offset.unwrap_or(NO_OFFSET).to_le_bytes());
        }
        let id_end = id_start + self.id.len();
        out[id_start..id_end].copy_from_slice(self.id);
        if self.state.has_claim_body() {
            let body = &mut out[id_end..];
            let result = self.result.unwrap_or(&[]);
            let mut flags = 0;
            if self.result.is_some() {
                flags |= FLAG_HAS_RESULT;
            }
            if self.claim.payload_fp.is_some() {
                flags |= FLAG_HAS_PAYLOAD;
            }
            body[ATTEMPTS_OFFSET..RESULT_LEN_OFFSET]
                .copy_from_slice(&self.claim.attempts.to_le_bytes());
            body[RESULT_LEN_OFFSET..LEASE_UNTIL_OFFSET]
                .copy_from_slice(&(result.len() as u32).to_le_bytes());
            body[LEASE_UNTIL_OFFSET..COMPLETED_OFFSET]
                .copy_from_slice(&self.claim.lease_until_ms.to_le_bytes());
            body[COMPLETED_OFFSET..PAYLOAD_FP_OFFSET]
                .copy_from_slice(&self.claim.completed_ms.to_le_bytes());
            body[PAYLOAD_FP_OFFSET..FLAGS_OFFSET]
                .copy_from_slice(&self.claim.payload_fp.unwrap_or(0).to_le_bytes());
            body[FLAGS_OFFSET..BODY_RESERVED_OFFSET].copy_from_slice(&flags.to_le_bytes());
            body[BODY_RESERVED_OFFSET..CLAIM_BODY_LEN].copy_from_slice(&0u32.to_le_bytes());
            body[CLAIM_BODY_LEN..].copy_from_slice(result);
        }
        let checksum = checksum32(&out[KIND_OFFSET..]);
        out[CHECKSUM_OFFSET..KIND_OFFSET].copy_from_slice(&checksum.to_le_bytes());
    }

    /// Encodes into a new vector (for tests).
    #[cfg(test)]
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.encoded_len()];
        self.encode_into(&mut out);
        out
    }
}

/// The fixed header alone, enough to size and locate a record without its body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub state: State,
    /// A partition-scoped kind: the scope follows the fixed header.
    pub scoped: bool,
    pub id_len: usize,
    pub namespace_id: u32,
    pub body_len: usize,
    pub lsn: u64,
    pub first_seen_ms: u64,
}

impl Header {
    pub(crate) fn record_len(&self) -> usize {
        HEADER_LEN + self.scope_len() + self.id_len + self.body_len
    }

    fn scope_len(&self) -> usize {
        if self.scoped { SCOPE_LEN } else { 0 }
    }

    /// Decodes the fixed header (no checksum check: the caller verifies the record
    /// with [`decode`] before trusting it, or reads a record it wrote itself).
    pub(crate) fn decode(bytes: &[u8]) -> Result<Header, DecodeError> {
        if bytes.len() < HEADER_LEN {
            return Err(DecodeError::Truncated);
        }
        let (state, scoped) = State::from_kind_and_status(bytes[KIND_OFFSET], bytes[STATUS_OFFSET])
            .ok_or(DecodeError::Invalid("unknown record kind or status"))?;
        let id_len = usize::from(read_u16(bytes, ID_LEN_OFFSET));
        if id_len == 0 {
            return Err(DecodeError::Invalid("empty id"));
        }
        let body_len = read_u32(bytes, BODY_LEN_OFFSET) as usize;
        let body_ok = if state.has_claim_body() {
            (CLAIM_BODY_LEN..=CLAIM_BODY_LEN + limits::RESULT_LEN_MAX).contains(&body_len)
        } else {
            body_len == 0
        };
        if !body_ok {
            return Err(DecodeError::Invalid(
                "body length out of range for the record kind",
            ));
        }
        Ok(Header {
            state,
            scoped,
            id_len,
            namespace_id: read_u32(bytes, NAMESPACE_ID_OFFSET),
            body_len,
            lsn: read_u64(bytes, LSN_OFFSET),
            first_seen_ms: read_u64(bytes, FIRST_SEEN_OFFSET),
        })
    }
}

/// Decodes and verifies the record at the start of `bytes`; returns it and its length.
/// Never panics and never allocates, whatever the bytes.
pub(crate) fn decode(bytes: &[u8]) -> Result<(StoredRecord<'_>, usize), DecodeError> {
    let header = Header::decode(bytes)?;
    let len = header.record_len();
    debug_assert!(len <= RECORD_LEN_MAX);
    if bytes.len() < len {
        return Err(DecodeError::Truncated);
    }
    let record_bytes = &bytes[..len];
    let stored = read_u32(record_bytes, CHECKSUM_OFFSET);
    if stored != checksum32(&record_bytes[KIND_OFFSET..]) {
        return Err(DecodeError::Invalid("checksum mismatch"));
    }
    let id_start = HEADER_LEN + header.scope_len();
    let placement = if header.scoped {
        let offset = read_u64(record_bytes, HEADER_LEN + 4);
        Placement {
            partition: Some(read_u32(record_bytes, HEADER_LEN)),
            offset: (offset != NO_OFFSET).then_some(offset),
        }
    } else {
        Placement::UNSCOPED
    };
    let id_end = id_start + header.id_len;
    let id = &record_bytes[id_start..id_end];
    let mut claim = ClaimFields::default();
    let mut result = None;
    if header.state.has_claim_body() {
        let body = &record_bytes[id_end..];
        let result_len = read_u32(body, RESULT_LEN_OFFSET) as usize;
        let flags = read_u32(body, FLAGS_OFFSET);
        if CLAIM_BODY_LEN + result_len != body.len() {
            return Err(DecodeError::Invalid(
                "result length disagrees with body length",
            ));
        }
        if flags & !(FLAG_HAS_RESULT | FLAG_HAS_PAYLOAD) != 0
            || read_u32(body, BODY_RESERVED_OFFSET) != 0
        {
            return Err(DecodeError::Invalid("unknown claim flags"));
        }
        if flags & FLAG_HAS_RESULT == 0 && result_len != 0 {
            return Err(DecodeError::Invalid(
                "result bytes without the has-result flag",
            ));
        }
        // The writer leaves the field zero without the flag: anything else is not a
        // record it wrote (and would not re-encode to the same bytes).
        if flags & FLAG_HAS_PAYLOAD == 0 && read_u64(body, PAYLOAD_FP_OFFSET) != 0 {
            return Err(DecodeError::Invalid(
                "a payload fingerprint without the has-payload flag",
            ));
        }
        claim = ClaimFields {
            attempts: read_u32(body, ATTEMPTS_OFFSET),
            lease_until_ms: read_u64(body, LEASE_UNTIL_OFFSET),
            completed_ms: read_u64(body, COMPLETED_OFFSET),
            payload_fp: (flags & FLAG_HAS_PAYLOAD != 0).then(|| read_u64(body, PAYLOAD_FP_OFFSET)),
        };
        if flags & FLAG_HAS_RESULT != 0 {
            result = Some(&body[CLAIM_BODY_LEN..]);
        }
    }
    let record = StoredRecord {
        state: header.state,
        namespace_id: header.namespace_id,
        placement,
        lsn: Lsn(header.lsn),
        first_seen_ms: header.first_seen_ms,
        id,
        claim,
        result,
    };
    debug_assert_eq!(record.encoded_len(), len);
    Ok((record, len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample(state: State, result: Option<&'static [u8]>) -> StoredRecord<'static> {
        StoredRecord {
            state,
            namespace_id: 3,
            placement: Placement::UNSCOPED,
            lsn: Lsn(99),
            first_seen_ms: 1_700_000_000_123,
            id: b"order-42",
            claim: if state.has_claim_body() {
                ClaimFields {
                    attempts: 2,
                    lease_until_ms: 5,
                    completed_ms: 6,
                    payload_fp: Some(77),
                }
            } else {
                ClaimFields::default()
            },
            result,
        }
    }

    #[test]
    fn a_mark_costs_32_bytes_plus_the_id() {
        let record = sample(State::Seen, None);
        assert_eq!(record.encode().len(), 32 + b"order-42".len());
    }

    #[test]
    fn every_state_round_trips() {
        for state in [State::Seen, State::Tombstone] {
            let bytes = sample(state, None).encode();
            assert_eq!(decode(&bytes), Ok((sample(state, None), bytes.len())));
        }
        for state in [
            State::InProgress,
            State::Released,
            State::Completed,
            State::Failed,
        ] {
            for result in [None, Some(&b""[..]), Some(&b"done: 7 units"[..])] {
                let record = sample(state, result);
                let bytes = record.encode();
                assert_eq!(decode(&bytes), Ok((record, bytes.len())));
            }
        }
    }

    #[test]
    fn scoped_records_round_trip_and_cost_12_bytes_more() {
        for offset in [None, Some(0), Some(u64::MAX - 1)] {
            for state in State::ALL {
                let result = state.has_claim_body().then_some(&b"r"[..]);
                let mut record = sample(state, result);
                let plain = record.encode().len();
                record.placement = Placement {
                    partition: Some(7),
                    offset,
                };
                let bytes = record.encode();
                assert_eq!(bytes.len(), plain + SCOPE_LEN);
                assert_eq!(decode(&bytes), Ok((record, bytes.len())));
                assert_eq!(Header::decode(&bytes).unwrap().record_len(), bytes.len());
            }
        }
    }

    #[test]
    fn zeros_and_truncations_never_validate() {
        assert!(decode(&[0u8; 256]).is_err());
        let bytes = sample(State::Completed, Some(b"result")).encode();
        for cut in 0..bytes.len() {
            assert_eq!(
                decode(&bytes[..cut]).err(),
                Some(DecodeError::Truncated),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn every_single_bit_flip_is_detected() {
        let bytes = sample(State::Completed, Some(b"result")).encode();
        for bit in 0..bytes.len() * 8 {
            let mut damaged = bytes.clone();
            damaged[bit / 8] ^= 1 << (bit % 8);
            assert!(decode(&damaged).is_err(), "flip of bit {bit} accepted");
        }
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = decode(&bytes);
        }
    }
}
