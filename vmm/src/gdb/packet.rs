//! GDB remote serial protocol framing: `$payload#checksum`, escaping and run-length encoding.
//!
//! Pure functions over bytes so that every corner (escapes, RLE, bad checksums, noise between
//! packets) is unit-tested without a server.

/// Errors of decoding one packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PacketError {
    /// The checksum does not match the payload.
    #[error("packet checksum {got:#04x} does not match the payload's {want:#04x}")]
    Checksum {
        /// Checksum sent.
        got: u8,
        /// Checksum computed.
        want: u8,
    },
    /// The two checksum characters are not hex digits.
    #[error("packet checksum is not two hex digits")]
    BadChecksumDigits,
    /// A run-length marker has nothing to repeat or a bad count.
    #[error("malformed run-length encoding at payload byte {0}")]
    BadRunLength(usize),
    /// The payload ends inside an escape.
    #[error("payload ends inside an escape sequence")]
    DanglingEscape,
}

/// The modulo-256 sum of the bytes.
pub fn checksum(bytes: &[u8]) -> u8 {
    bytes.iter().fold(0u8, |acc, b| acc.wrapping_add(*b))
}

/// Frames a payload as `$escaped#xx`, escaping `$ # } *`.
pub fn encode(payload: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(payload.len() + 4);
    for &b in payload {
        if matches!(b, b'$' | b'#' | b'}' | b'*') {
            body.push(b'}');
            body.push(b ^ 0x20);
        } else {
            body.push(b);
        }
    }
    let mut out = Vec::with_capacity(body.len() + 4);
    out.push(b'$');
    out.extend_from_slice(&body);
    out.extend_from_slice(format!("#{:02x}", checksum(&body)).as_bytes());
    out
}

fn hex_digit(c: u8) -> Option<u8> {
    (c as char).to_digit(16).and_then(|d| u8::try_from(d).ok())
}

/// Checks the checksum of a framed body (between `$` and `#`) and undoes escaping and
/// run-length encoding.
///
/// # Errors
/// A bad checksum or malformed encoding.
pub fn decode(body: &[u8], sum: [u8; 2]) -> Result<Vec<u8>, PacketError> {
    let got = match (hex_digit(sum[0]), hex_digit(sum[1])) {
        (Some(h), Some(l)) => (h << 4) | l,
        _ => return Err(PacketError::BadChecksumDigits),
    };
    let want = checksum(body);
    if got != want {
        return Err(PacketError::Checksum { got, want });
    }
    let mut out = Vec::with_capacity(body.len());
    let mut i = 0;
    while i < body.len() {
        match body[i] {
            b'}' => {
                let next = *body.get(i + 1).ok_or(PacketError::DanglingEscape)?;
                out.push(next ^ 0x20);
                i += 2;
            }
            b'*' => {
                // `X*n`: repeat the previous byte (n - 29) more times; n is printable.
                let last = *out.last().ok_or(PacketError::BadRunLength(i))?;
                let n = *body.get(i + 1).ok_or(PacketError::BadRunLength(i))?;
                let count = n
                    .checked_sub(29)
                    .filter(|c| *c > 0)
                    .ok_or(PacketError::BadRunLength(i))?;
                out.extend(std::iter::repeat_n(last, usize::from(count)));
                i += 2;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    Ok(out)
}

/// Lower-case hex of bytes.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Bytes from hex; `None` for odd length or non-hex characters. `xx` (unavailable register
/// bytes in QEMU replies) decode as zero.
pub fn from_hex(text: &[u8]) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    text.chunks_exact(2)
        .map(|p| match p {
            b"xx" => Some(0),
            _ => Some((hex_digit(p[0])? << 4) | hex_digit(p[1])?),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(framed: &[u8]) -> (&[u8], [u8; 2]) {
        let n = framed.len();
        (&framed[1..n - 3], [framed[n - 2], framed[n - 1]])
    }

    #[test]
    fn encode_matches_the_protocol_example() {
        // "qSupported" framed by gdb itself: $qSupported#37
        assert_eq!(encode(b"qSupported"), b"$qSupported#37".to_vec());
    }

    #[test]
    fn special_bytes_round_trip_through_escapes() {
        let payload = b"X1000,4:$#}*".to_vec();

        let framed = encode(&payload);
        let (body, sum) = split(&framed);

        assert_eq!(body, b"X1000,4:}\x04}\x03}]}\x0a");
        assert_eq!(decode(body, sum).unwrap(), payload);
    }

    #[test]
    fn run_length_encoding_expands() {
        // "0* " is '0' followed by 3 more ('space' is 32, 32-29 = 3).
        let body = b"0* 1";

        let out = decode(
            body,
            *format!("{:02x}", checksum(body))
                .as_bytes()
                .first_chunk()
                .unwrap(),
        )
        .unwrap();

        assert_eq!(out, b"00001");
    }

    #[test]
    fn bad_checksum_and_malformed_bodies_are_errors() {
        assert_eq!(
            decode(b"OK", *b"00"),
            Err(PacketError::Checksum { got: 0, want: 0x9a })
        );
        assert_eq!(decode(b"OK", *b"zz"), Err(PacketError::BadChecksumDigits));
        let sum = |b: &[u8]| {
            *format!("{:02x}", checksum(b))
                .as_bytes()
                .first_chunk()
                .unwrap()
        };
        assert_eq!(decode(b"*!", sum(b"*!")), Err(PacketError::BadRunLength(0)));
        assert_eq!(decode(b"a*", sum(b"a*")), Err(PacketError::BadRunLength(1)));
        assert_eq!(decode(b"a}", sum(b"a}")), Err(PacketError::DanglingEscape));
    }

    #[test]
    fn hex_round_trips_and_rejects_garbage() {
        assert_eq!(
            from_hex(to_hex(&[0, 0x7f, 0xff]).as_bytes()).unwrap(),
            [0, 0x7f, 0xff]
        );
        assert_eq!(from_hex(b"xx01").unwrap(), [0, 1]);
        assert_eq!(from_hex(b"abc"), None);
        assert_eq!(from_hex(b"zz"), None);
    }
}
