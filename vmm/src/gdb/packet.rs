//! GDB remote serial protocol framing: `$payload#checksum`, escaping and run-length encoding.
//!
//! Pure functions over bytes so that every corner (escapes, RLE, bad checksums, noise between
//! packets) is unit-tested without a server. Everything from the stub is bounded: a packet's
//! length before its `#` ([`MAX_BODY`]), what it expands to ([`MAX_PAYLOAD`]) and the noise
//! between packets ([`MAX_NOISE`]), so a hostile or broken peer costs bounded memory and
//! gives an error instead of a hang.

/// The most bytes between `$` and `#` accepted from the stub. QEMU's largest replies (a
/// 4 KiB memory read in hex, a register file, a target description chunk) are under 10 KiB.
pub const MAX_BODY: usize = 128 * 1024;
/// The most bytes one packet may expand to (run-length encoding expands up to 49 times).
pub const MAX_PAYLOAD: usize = 256 * 1024;
/// The most bytes outside packets, acks aside, tolerated before the stream is garbage.
pub const MAX_NOISE: usize = 64 * 1024;

/// Errors of decoding one packet, or of a byte stream that holds no more packets.
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
    /// A `$` came before the packet's `#`: the packet was cut off.
    #[error("a packet was cut off by the start of another")]
    Truncated,
    /// No `#` within [`MAX_BODY`] bytes.
    #[error("a packet runs past {limit} bytes without its end marker")]
    TooLong {
        /// The limit.
        limit: usize,
    },
    /// The payload expands past [`MAX_PAYLOAD`] bytes.
    #[error("a packet expands past {limit} bytes")]
    TooLarge {
        /// The limit.
        limit: usize,
    },
    /// More than [`MAX_NOISE`] bytes outside any packet.
    #[error("{bytes} bytes of garbage outside any packet")]
    Noise {
        /// The garbage bytes seen since the last packet.
        bytes: usize,
    },
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
/// A bad checksum, malformed encoding, or a payload longer than [`MAX_PAYLOAD`].
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
                if out.len() + usize::from(count) > MAX_PAYLOAD {
                    return Err(PacketError::TooLarge { limit: MAX_PAYLOAD });
                }
                out.extend(std::iter::repeat_n(last, usize::from(count)));
                i += 2;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
        if out.len() > MAX_PAYLOAD {
            return Err(PacketError::TooLarge { limit: MAX_PAYLOAD });
        }
    }
    Ok(out)
}

/// What the stub's byte stream holds next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// A packet with a valid checksum and encoding: its payload.
    Packet(Vec<u8>),
    /// A whole packet whose checksum or encoding is bad (in ack mode: ask for it again).
    Corrupt(PacketError),
    /// `-`: the peer asks for our last packet again (it arrived corrupt).
    Nak,
}

/// Splits a peer's byte stream into [`Frame`]s in bounded memory: acks (`+`) are dropped,
/// other bytes outside packets are counted as noise up to [`MAX_NOISE`].
#[derive(Debug, Default)]
pub struct PacketReader {
    buf: Vec<u8>,
    noise: usize,
}

impl PacketReader {
    /// An empty reader.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends bytes read from the peer.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes held that are not a whole frame yet.
    #[must_use]
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// The next frame, or `None` until more bytes arrive.
    ///
    /// # Errors
    /// [`PacketError::Noise`] or [`PacketError::TooLong`]: the stream holds garbage, not
    /// packets, and reading on would not help.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, PacketError> {
        // Up to the next `$`: acks, naks and noise.
        let mut skip = 0;
        let mut nak = false;
        for &b in &self.buf {
            match b {
                b'$' => break,
                b'+' => {}
                b'-' => {
                    nak = true;
                    skip += 1;
                    break;
                }
                _ => self.noise += 1,
            }
            skip += 1;
        }
        self.buf.drain(..skip);
        if self.noise > MAX_NOISE {
            return Err(PacketError::Noise { bytes: self.noise });
        }
        if nak {
            return Ok(Some(Frame::Nak));
        }
        if self.buf.is_empty() {
            return Ok(None);
        }
        // `$body#xx`; a `$` in the body means the packet was cut off and another began.
        let Some(end) = self.buf[1..].iter().position(|b| matches!(b, b'#' | b'$')) else {
            if self.buf.len() - 1 > MAX_BODY {
                return Err(PacketError::TooLong { limit: MAX_BODY });
            }
            return Ok(None);
        };
        let end = end + 1;
        if end - 1 > MAX_BODY {
            return Err(PacketError::TooLong { limit: MAX_BODY });
        }
        if self.buf[end] == b'$' {
            self.buf.drain(..end);
            return Ok(Some(Frame::Corrupt(PacketError::Truncated)));
        }
        let (Some(&hi), Some(&lo)) = (self.buf.get(end + 1), self.buf.get(end + 2)) else {
            return Ok(None);
        };
        let decoded = decode(&self.buf[1..end], [hi, lo]);
        self.buf.drain(..end + 3);
        self.noise = 0;
        Ok(Some(match decoded {
            Ok(payload) => Frame::Packet(payload),
            Err(e) => Frame::Corrupt(e),
        }))
    }
}

/// Lower-case hex of bytes.
pub fn to_hex(bytes: &[u8]) -> String {
    // A table, not `format!` per byte: every byte of text and patch code written over the
    // gdbstub passes through here (hundreds of KB for one batch of splices).
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    out
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

    fn frames(reader: &mut PacketReader) -> Vec<Frame> {
        std::iter::from_fn(|| reader.next_frame().unwrap()).collect()
    }

    #[test]
    fn reader_splits_packets_and_drops_acks() {
        let mut reader = PacketReader::new();
        reader.push(b"+$OK#9a+$T05#b9$E0");

        let got = frames(&mut reader);
        reader.push(b"1#a6");

        assert_eq!(
            got,
            [
                Frame::Packet(b"OK".to_vec()),
                Frame::Packet(b"T05".to_vec())
            ]
        );
        assert_eq!(frames(&mut reader), [Frame::Packet(b"E01".to_vec())]);
        assert_eq!(reader.pending(), 0);
    }

    #[test]
    fn reader_reports_corrupt_packets_and_naks_and_goes_on() {
        let mut reader = PacketReader::new();
        reader.push(b"$OK#00-$OK#9a");

        assert_eq!(
            frames(&mut reader),
            [
                Frame::Corrupt(PacketError::Checksum { got: 0, want: 0x9a }),
                Frame::Nak,
                Frame::Packet(b"OK".to_vec())
            ]
        );
    }

    #[test]
    fn packet_cut_off_by_another_is_corrupt_and_the_next_one_is_read() {
        let mut reader = PacketReader::new();
        reader.push(b"$O$OK#9a");

        assert_eq!(
            frames(&mut reader),
            [
                Frame::Corrupt(PacketError::Truncated),
                Frame::Packet(b"OK".to_vec())
            ]
        );
    }

    #[test]
    fn endless_packet_is_refused_at_the_body_limit() {
        let mut reader = PacketReader::new();
        reader.push(b"$");
        reader.push(&vec![b'a'; MAX_BODY]);
        let short_of_the_limit = reader.next_frame();
        reader.push(b"a");

        let result = reader.next_frame();

        assert_eq!(short_of_the_limit, Ok(None));
        assert_eq!(result, Err(PacketError::TooLong { limit: MAX_BODY }));
    }

    #[test]
    fn garbage_between_packets_is_refused_past_the_noise_limit() {
        let mut reader = PacketReader::new();
        reader.push(&vec![b'z'; MAX_NOISE + 1]);

        let result = reader.next_frame();

        assert_eq!(
            result,
            Err(PacketError::Noise {
                bytes: MAX_NOISE + 1
            })
        );
        assert_eq!(reader.pending(), 0);
    }

    #[test]
    fn a_packet_resets_the_noise_count() {
        let mut reader = PacketReader::new();
        reader.push(&vec![b'z'; MAX_NOISE]);
        reader.push(b"$OK#9a");
        reader.push(&vec![b'z'; MAX_NOISE]);

        let got = frames(&mut reader);

        assert_eq!(got, [Frame::Packet(b"OK".to_vec())]);
    }

    #[test]
    fn acks_are_not_noise() {
        let mut reader = PacketReader::new();
        reader.push(&vec![b'+'; 2 * MAX_NOISE]);

        assert_eq!(reader.next_frame(), Ok(None));
    }

    #[test]
    fn huge_run_length_expansion_is_refused() {
        // Each `*~` repeats the last byte 97 times: 4000 of them expand to ~388 KiB.
        let mut body = b"a".to_vec();
        for _ in 0..4000 {
            body.extend_from_slice(b"*~");
        }
        let sum = *format!("{:02x}", checksum(&body))
            .as_bytes()
            .first_chunk()
            .unwrap();

        assert_eq!(
            decode(&body, sum),
            Err(PacketError::TooLarge { limit: MAX_PAYLOAD })
        );
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
