//! A minimal protocol-buffers wire-format reader: enough to walk the fields
//! of a SentencePiece `ModelProto` without a code generator.

use anyhow::{Result, bail};

/// One field's payload, by wire type.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Field<'a> {
    Varint(u64),
    Fixed64(u64),
    Bytes(&'a [u8]),
    Fixed32(u32),
}

impl Field<'_> {
    /// The field as a float (protobuf `float` travels as fixed32).
    pub(crate) fn as_f32(&self) -> Option<f32> {
        match *self {
            Field::Fixed32(bits) => Some(f32::from_bits(bits)),
            _ => None,
        }
    }

    /// The field as an `int32`/`enum`/`bool`; negative int32 values travel as
    /// ten-byte varints, which truncate back correctly.
    pub(crate) fn as_i32(&self) -> Option<i32> {
        match *self {
            Field::Varint(v) => Some(v as i32),
            _ => None,
        }
    }
}

/// Iterates over the (field number, payload) pairs of one message.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, pos: 0 }
    }

    fn varint(&mut self) -> Result<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let Some(&b) = self.buf.get(self.pos) else {
                bail!(
                    "protobuf: message ends inside a varint at byte {}",
                    self.pos
                );
            };
            self.pos += 1;
            value |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(value);
            }
        }
        bail!("protobuf: varint longer than 10 bytes at byte {}", self.pos)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        let Some(end) = end else {
            bail!(
                "protobuf: field of {n} bytes at byte {} runs past the end ({} bytes)",
                self.pos,
                self.buf.len()
            );
        };
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    /// The next field, `None` at the end of the message.
    pub(crate) fn next_field(&mut self) -> Result<Option<(u32, Field<'a>)>> {
        if self.pos >= self.buf.len() {
            return Ok(None);
        }
        let key = self.varint()?;
        let number = u32::try_from(key >> 3)
            .map_err(|_| anyhow::anyhow!("protobuf: field number {} too large", key >> 3))?;
        let field = match key & 7 {
            0 => Field::Varint(self.varint()?),
            1 => Field::Fixed64(u64::from_le_bytes(self.take(8)?.try_into()?)),
            2 => {
                let len = usize::try_from(self.varint()?)?;
                Field::Bytes(self.take(len)?)
            }
            5 => Field::Fixed32(u32::from_le_bytes(self.take(4)?.try_into()?)),
            w => bail!("protobuf: unsupported wire type {w} for field {number}"),
        };
        Ok(Some((number, field)))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Writers for building test messages by hand.
    pub(crate) fn put_varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    pub(crate) fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
        put_varint(out, (u64::from(field) << 3) | 2);
        put_varint(out, bytes.len() as u64);
        out.extend_from_slice(bytes);
    }

    #[test]
    fn reads_each_wire_type() {
        let mut m = Vec::new();
        put_varint(&mut m, 1 << 3); // field 1, varint
        put_varint(&mut m, 300);
        put_bytes(&mut m, 2, b"hi");
        put_varint(&mut m, (3 << 3) | 5);
        m.extend_from_slice(&1.5f32.to_bits().to_le_bytes());
        put_varint(&mut m, (4 << 3) | 1);
        m.extend_from_slice(&7u64.to_le_bytes());
        put_varint(&mut m, 5 << 3);
        put_varint(&mut m, (-1i64) as u64); // negative int32 as 10 bytes
        let mut r = Reader::new(&m);
        assert_eq!(r.next_field().unwrap(), Some((1, Field::Varint(300))));
        assert_eq!(r.next_field().unwrap(), Some((2, Field::Bytes(b"hi"))));
        let (n, f) = r.next_field().unwrap().unwrap();
        assert_eq!((n, f.as_f32()), (3, Some(1.5)));
        assert_eq!(r.next_field().unwrap(), Some((4, Field::Fixed64(7))));
        let (n, f) = r.next_field().unwrap().unwrap();
        assert_eq!((n, f.as_i32()), (5, Some(-1)));
        assert_eq!(r.next_field().unwrap(), None);
    }

    #[test]
    fn truncation_is_an_error() {
        let mut m = Vec::new();
        put_bytes(&mut m, 1, b"hello");
        m.truncate(m.len() - 1);
        assert!(Reader::new(&m).next_field().is_err());
        assert!(Reader::new(&[0x08, 0x80]).next_field().is_err());
        assert!(
            Reader::new(&[0x0b]).next_field().is_err(),
            "group wire type"
        );
    }
}
