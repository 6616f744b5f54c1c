//! The JSON-lines form of a consumption record (`scan`, `export`, `import`) and the
//! human forms of times, bytes and sizes. The store's files never go through JSON:
//! this is only the tool's text interface.
//!
//! One record per line:
//! `{"namespace":"inventory","id":"order-7","status":"completed","first_seen_ms":…,
//! "expires_at_ms":…,"attempts":1,"lease_until_ms":null,"completed_at_ms":…,
//! "result":"ok"}`. An id or result that is not UTF-8 is written as `id_hex` /
//! `result_hex` instead. A partition's record ends with `"partition":3,"offset":…`
//! (the offset `null` when none was recorded).

use idemstore::{Record, Status, UnixMs};
use serde_json::Value;

/// Every status, by its name in JSON and on the command line.
pub const STATUSES: [Status; 5] = [
    Status::Seen,
    Status::InProgress,
    Status::Released,
    Status::Completed,
    Status::Failed,
];

pub fn parse_status(name: &str) -> Result<Status, String> {
    STATUSES
        .into_iter()
        .find(|s| s.as_str() == name)
        .ok_or_else(|| {
            format!(
                "unknown status {name:?}; use one of {}",
                STATUSES.map(|s| s.as_str()).join(", ")
            )
        })
}

/// `"key":"text"` (UTF-8) or `"key_hex":"…"` (anything else).
fn bytes_field(key: &str, bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) => format!("\"{key}\":{}", Value::from(text)),
        Err(_) => format!("\"{key}_hex\":\"{}\"", hex(bytes)),
    }
}

fn optional(value: Option<UnixMs>) -> String {
    value.map_or("null".to_string(), |t| t.0.to_string())
}

/// One record as one line of JSON, fields in a fixed order (written by hand so the
/// order is the documented one; strings are escaped by `serde_json`).
pub fn to_json(namespace: &str, id: &[u8], record: &Record) -> String {
    // A partition's record also says where it came from (unscoped records keep the
    // v1 line, byte for byte).
    let placement = match record.partition {
        Some(p) => format!(
            ",\"partition\":{p},\"offset\":{}",
            record.offset.map_or("null".to_string(), |o| o.to_string())
        ),
        None => String::new(),
    };
    format!(
        "{{\"namespace\":{},{},\"status\":\"{}\",\"first_seen_ms\":{},\"expires_at_ms\":{},\"attempts\":{},\"lease_until_ms\":{},\"completed_at_ms\":{},{}{placement}}}",
        Value::from(namespace),
        bytes_field("id", id),
        record.status.as_str(),
        record.first_seen.0,
        record.expires_at.0,
        record.attempts,
        optional(record.lease_until),
        optional(record.completed_at),
        match &record.result {
            Some(result) => bytes_field("result", result),
            None => "\"result\":null".to_string(),
        }
    )
}

/// Parses one line of `export` output back into `(namespace, id, record)`.
pub fn from_json(line: &str) -> Result<(String, Vec<u8>, Record), String> {
    let value: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    let object = value
        .as_object()
        .ok_or("not a JSON object; each line must be one record as `idemstore export` writes it")?;
    let text = |key: &str| object.get(key).and_then(Value::as_str);
    let number = |key: &str| -> Result<Option<u64>, String> {
        match object.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| format!("{key:?} must be a non-negative integer")),
        }
    };
    let bytes = |key: &str| -> Result<Option<Vec<u8>>, String> {
        if let Some(text) = text(key) {
            return Ok(Some(text.as_bytes().to_vec()));
        }
        match text(&format!("{key}_hex")) {
            Some(h) => unhex(h).map(Some).map_err(|e| format!("{key}_hex: {e}")),
            None => Ok(None),
        }
    };
    let namespace = text("namespace")
        .ok_or("missing \"namespace\"")?
        .to_string();
    let id = bytes("id")?.ok_or("missing \"id\" (or \"id_hex\")")?;
    let status = parse_status(text("status").ok_or("missing \"status\"")?)?;
    let record = Record {
        status,
        first_seen: UnixMs(number("first_seen_ms")?.ok_or("missing \"first_seen_ms\"")?),
        expires_at: UnixMs(number("expires_at_ms")?.ok_or("missing \"expires_at_ms\"")?),
        attempts: u32::try_from(number("attempts")?.unwrap_or(0))
            .map_err(|_| "\"attempts\" is larger than 2^32 - 1")?,
        lease_until: number("lease_until_ms")?.map(UnixMs),
        completed_at: number("completed_at_ms")?.map(UnixMs),
        result: bytes("result")?,
        partition: number("partition")?
            .map(|p| u32::try_from(p).map_err(|_| "\"partition\" is larger than 2^32 - 1"))
            .transpose()?,
        offset: number("offset")?,
    };
    if record.offset.is_some() && record.partition.is_none() {
        return Err("\"offset\" without \"partition\"".to_string());
    }
    Ok((namespace, id, record))
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn unhex(text: &str) -> Result<Vec<u8>, String> {
    if !text.len().is_multiple_of(2) {
        return Err("odd number of hex digits".to_string());
    }
    (0..text.len())
        .step_by(2)
        .map(|i| {
            text.get(i..i + 2)
                .and_then(|pair| u8::from_str_radix(pair, 16).ok())
                .ok_or_else(|| format!("not hex at position {i}"))
        })
        .collect()
}

/// `2026-12-02T09:53:23.123Z`: UTC, from Unix milliseconds.
pub fn utc(time: UnixMs) -> String {
    let ms = time.0;
    let days = (ms / 86_400_000) as i64;
    let in_day = ms % 86_400_000;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        in_day / 3_600_000,
        in_day / 60_000 % 60,
        in_day / 1_000 % 60,
        in_day % 1_000
    )
}

/// `12.3 MiB`.
pub fn bytes_human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// `1,234,567`.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}
