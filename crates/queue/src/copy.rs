//! An encoder for PostgreSQL's binary `COPY` format, for the columns the bulk insert writes.
//!
//! Format (PostgreSQL docs, "Binary Format"): an 11-byte signature, a flags word and a header
//! extension length; then per row a 16-bit field count and per field a 32-bit length and the value
//! in the type's binary send format; a 16-bit -1 ends the data.

use chrono::{DateTime, Utc};
use serde_json::{Map, Value};

const SIGNATURE: &[u8] = b"PGCOPY\n\xff\r\n\0";
/// Microseconds between the Unix epoch and PostgreSQL's epoch (2000-01-01).
const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;
/// jsonb's binary format starts with a version byte.
const JSONB_VERSION: u8 = 1;

pub(crate) struct CopyEncoder {
    buf: Vec<u8>,
}

impl CopyEncoder {
    pub(crate) fn new() -> Self {
        let mut buf = Vec::with_capacity(1 << 20);
        buf.extend_from_slice(SIGNATURE);
        buf.extend_from_slice(&0i32.to_be_bytes()); // flags
        buf.extend_from_slice(&0i32.to_be_bytes()); // header extension length
        CopyEncoder { buf }
    }

    pub(crate) fn begin_row(&mut self, fields: i16) {
        self.buf.extend_from_slice(&fields.to_be_bytes());
    }

    fn field(&mut self, bytes: &[u8]) {
        let len = i32::try_from(bytes.len()).unwrap_or(i32::MAX);
        self.buf.extend_from_slice(&len.to_be_bytes());
        self.buf.extend_from_slice(bytes);
    }

    /// `text`, `varchar` and enum labels share the same binary form: the UTF-8 bytes.
    pub(crate) fn text(&mut self, s: &str) {
        self.field(s.as_bytes());
    }

    pub(crate) fn int2(&mut self, v: i16) {
        self.field(&v.to_be_bytes());
    }

    pub(crate) fn timestamptz(&mut self, t: DateTime<Utc>) {
        let micros = t.timestamp_micros() - PG_EPOCH_OFFSET_MICROS;
        self.field(&micros.to_be_bytes());
    }

    pub(crate) fn jsonb(&mut self, v: &Value) -> Result<(), serde_json::Error> {
        self.jsonb_with(|out| serde_json::to_writer(out, v))
    }

    pub(crate) fn jsonb_map(&mut self, m: &Map<String, Value>) -> Result<(), serde_json::Error> {
        self.jsonb_with(|out| serde_json::to_writer(out, m))
    }

    fn jsonb_with(
        &mut self,
        write: impl FnOnce(&mut Vec<u8>) -> Result<(), serde_json::Error>,
    ) -> Result<(), serde_json::Error> {
        let len_at = self.buf.len();
        self.buf.extend_from_slice(&0i32.to_be_bytes());
        self.buf.push(JSONB_VERSION);
        write(&mut self.buf)?;
        let len = i32::try_from(self.buf.len() - len_at - 4).unwrap_or(i32::MAX);
        self.buf[len_at..len_at + 4].copy_from_slice(&len.to_be_bytes());
        Ok(())
    }

    pub(crate) fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Takes the bytes encoded so far, leaving the encoder ready for more rows.
    pub(crate) fn take(&mut self) -> Vec<u8> {
        std::mem::replace(&mut self.buf, Vec::with_capacity(1 << 20))
    }

    /// Appends the trailer and returns the remaining bytes.
    pub(crate) fn finish(mut self) -> Vec<u8> {
        self.buf.extend_from_slice(&(-1i16).to_be_bytes());
        self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_row_and_trailer_layout() {
        let mut e = CopyEncoder::new();
        e.begin_row(2);
        e.int2(7);
        e.jsonb(&serde_json::json!({"a":1})).unwrap();
        let bytes = e.finish();
        let mut expected = SIGNATURE.to_vec();
        expected.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0]);
        expected.extend_from_slice(&[0, 2]); // two fields
        expected.extend_from_slice(&[0, 0, 0, 2, 0, 7]); // int2 7
        let json = br#"{"a":1}"#;
        expected.extend_from_slice(&(json.len() as i32 + 1).to_be_bytes());
        expected.push(1);
        expected.extend_from_slice(json);
        expected.extend_from_slice(&[0xff, 0xff]);
        assert_eq!(bytes, expected);
    }

    #[test]
    fn timestamps_count_from_2000() {
        let mut e = CopyEncoder::new();
        let header = e.buffered();
        e.timestamptz(
            DateTime::parse_from_rfc3339("2000-01-01T00:00:01Z")
                .unwrap()
                .into(),
        );
        let bytes = e.take();
        assert_eq!(&bytes[header..header + 4], &8i32.to_be_bytes());
        assert_eq!(&bytes[header + 4..], &1_000_000i64.to_be_bytes());
    }
}
