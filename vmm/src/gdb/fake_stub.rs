//! A scripted gdbstub for tests: a TCP server thread that plays one connection from a
//! script of steps — well-formed replies, raw bytes (malformed, truncated, bad checksums),
//! endless floods, silence, hang-ups — so the client's behaviour against a broken or
//! hostile peer is tested without QEMU.
//!
//! The tests at the bottom hold the client to its promise: every such peer gives a clear
//! error, within a bounded time, never a hang or a panic.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::Duration;

use super::packet::{encode, Frame, PacketReader};

/// One step of a scripted stub.
#[derive(Debug, Clone)]
pub(crate) enum Step {
    /// Reads packets (and interrupt bytes) until one arrives; panics (failing the server
    /// thread, seen at [`FakeStub::finish`]) when it does not start with this prefix.
    Expect(&'static str),
    /// Reads raw bytes until the interrupt byte `0x03` arrives.
    ExpectInterrupt,
    /// Sends a well-formed packet with this payload.
    Reply(Vec<u8>),
    /// Sends these bytes as they are.
    Raw(Vec<u8>),
    /// Sends these bytes again and again until the client hangs up.
    Flood(Vec<u8>),
    /// Answers every packet from now on with these bytes, as they are, until the client
    /// hangs up.
    AnswerAll(Vec<u8>),
    /// Reads and ignores everything until the client hangs up.
    Silence,
    /// Waits.
    Sleep(Duration),
    /// Closes the connection.
    Close,
}

/// A reply step from text.
pub(crate) fn reply(payload: &str) -> Step {
    Step::Reply(payload.as_bytes().to_vec())
}

/// Raw bytes from text.
pub(crate) fn raw(bytes: &str) -> Step {
    Step::Raw(bytes.as_bytes().to_vec())
}

/// The steps of [`super::GdbClient::connect`]'s handshake with a stub that offers no-ack
/// mode and no target description.
pub(crate) fn handshake() -> Vec<Step> {
    vec![
        Step::Expect("qSupported"),
        reply("PacketSize=1000;QStartNoAckMode+"),
        Step::Expect("QStartNoAckMode"),
        reply("OK"),
        Step::Expect("Qqemu.PhyMemMode:0"),
        reply("OK"),
    ]
}

/// The same handshake in ack mode (no `QStartNoAckMode`): the client acks every packet.
pub(crate) fn handshake_with_acks() -> Vec<Step> {
    vec![
        Step::Expect("qSupported"),
        reply("PacketSize=1000"),
        Step::Expect("Qqemu.PhyMemMode:0"),
        reply("OK"),
    ]
}

/// A QEMU-like x86-64 description: the 16 GPRs, rip, eflags, the six segments, the bases
/// and the control registers.
pub(crate) const TARGET_XML: &str = r#"<?xml version="1.0"?><target><feature name="org.gnu.gdb.i386.core"><reg name="rax" bitsize="64"/><reg name="rbx" bitsize="64"/><reg name="rcx" bitsize="64"/><reg name="rdx" bitsize="64"/><reg name="rsi" bitsize="64"/><reg name="rdi" bitsize="64"/><reg name="rbp" bitsize="64"/><reg name="rsp" bitsize="64"/><reg name="r8" bitsize="64"/><reg name="r9" bitsize="64"/><reg name="r10" bitsize="64"/><reg name="r11" bitsize="64"/><reg name="r12" bitsize="64"/><reg name="r13" bitsize="64"/><reg name="r14" bitsize="64"/><reg name="r15" bitsize="64"/><reg name="rip" bitsize="64"/><reg name="eflags" bitsize="32"/><reg name="cs" bitsize="32"/><reg name="ss" bitsize="32"/><reg name="ds" bitsize="32"/><reg name="es" bitsize="32"/><reg name="fs" bitsize="32"/><reg name="gs" bitsize="32"/><reg name="fs_base" bitsize="64"/><reg name="gs_base" bitsize="64"/><reg name="k_gs_base" bitsize="64"/><reg name="cr0" bitsize="64"/><reg name="cr2" bitsize="64"/><reg name="cr3" bitsize="64"/><reg name="cr4" bitsize="64"/><reg name="efer" bitsize="64"/></feature></target>"#;

/// Bytes of the `g` packet of [`TARGET_XML`], up to the segments: as QEMU, the stub leaves
/// bases and control registers to `p`.
pub(crate) const G_BYTES: usize = 17 * 8 + 7 * 4;

/// The handshake of [`super::GdbMachine::connect`]: features with a target description,
/// the stop reason, one thread.
pub(crate) fn machine_handshake() -> Vec<Step> {
    vec![
        Step::Expect("qSupported"),
        reply("PacketSize=1000;QStartNoAckMode+;qXfer:features:read+"),
        Step::Expect("QStartNoAckMode"),
        reply("OK"),
        Step::Expect("qXfer:features:read:target.xml:0,"),
        Step::Reply(format!("l{TARGET_XML}").into_bytes()),
        Step::Expect("Qqemu.PhyMemMode:0"),
        reply("OK"),
        Step::Expect("?"),
        reply("T05thread:01;"),
        Step::Expect("qfThreadInfo"),
        reply("m01"),
        Step::Expect("qsThreadInfo"),
        reply("l"),
    ]
}

/// Replies of every shape the client parses, as QEMU sends them: seeds for mutation.
pub(crate) const SEED_REPLIES: &[&[u8]] = &[
    b"OK",
    b"E14",
    b"",
    b"T05thread:01;swbreak:;",
    b"T02thread:p1.2;",
    b"S05",
    b"W00",
    b"X09;process:1",
    b"O48656c6c6f0a",
    b"m01,02,03",
    b"l",
    b"deadbeef00112233",
    b"xxxx0000ffffffff",
    b"PacketSize=1000;qXfer:features:read+;QStartNoAckMode+;vContSupported+",
    b"l<target><reg name=\"rip\" bitsize=\"64\" regnum=\"16\"/></target>",
    b"m<target><xi:include href=\"64bit-core.xml\"/>",
];

/// A xorshift64 generator: deterministic pseudo-random cases.
#[derive(Debug)]
pub(crate) struct XorShift(pub(crate) u64);

impl XorShift {
    pub(crate) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// A number below `n` (`n` > 0).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// `bytes` with one to four random mutations: flipped bits, protocol-significant bytes
/// put in or over, ranges cut, repeated or truncated, pieces of another seed spliced in.
pub(crate) fn mutate(rng: &mut XorShift, bytes: &[u8]) -> Vec<u8> {
    const SPECIAL: &[u8] = b"$#*}+-~ 0xX:;,\x03\xff\x00";
    let mut out = bytes.to_vec();
    for _ in 0..=rng.below(4) {
        let at = rng.below(out.len() + 1);
        match rng.below(7) {
            0 if at < out.len() => out[at] ^= 1 << rng.below(8),
            1 if at < out.len() => out[at] = SPECIAL[rng.below(SPECIAL.len())],
            2 => out.insert(at, SPECIAL[rng.below(SPECIAL.len())]),
            3 => {
                let end = (at + rng.below(8)).min(out.len());
                out.drain(at..end);
            }
            4 => {
                let end = (at + rng.below(16)).min(out.len());
                let piece = out[at..end].to_vec();
                for _ in 0..rng.below(64) {
                    out.extend_from_slice(&piece);
                }
            }
            5 => out.truncate(at),
            _ => {
                let other = SEED_REPLIES[rng.below(SEED_REPLIES.len())];
                let from = rng.below(other.len() + 1);
                let at = at.min(out.len());
                out.splice(at..at, other[from..].iter().copied());
            }
        }
    }
    out
}

/// A running scripted stub.
#[derive(Debug)]
pub(crate) struct FakeStub {
    /// `tcp:127.0.0.1:PORT`.
    pub(crate) addr: String,
    server: JoinHandle<()>,
}

impl FakeStub {
    /// Listens on a free local port and plays `script` to the first client.
    pub(crate) fn start(script: Vec<Step>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = format!("tcp:{}", listener.local_addr().unwrap());
        let server = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            play(stream, script);
        });
        Self { addr, server }
    }

    /// Waits for the script to end (call after the client is dropped); panics if the
    /// stub saw something other than its script expected.
    pub(crate) fn finish(self) {
        if let Err(panic) = self.server.join() {
            std::panic::resume_unwind(panic);
        }
    }
}

/// Reads the next packet (or interrupt byte) from the client; `None` once it hung up.
fn next_request(stream: &mut TcpStream, reader: &mut PacketReader) -> Option<Vec<u8>> {
    loop {
        match reader.next_frame() {
            Ok(Some(Frame::Packet(payload))) => return Some(payload),
            Ok(Some(Frame::Corrupt(e))) => panic!("the client sent a corrupt packet: {e}"),
            Ok(Some(Frame::Nak)) => {}
            Ok(None) => {
                let mut buf = [0u8; 4096];
                match stream.read(&mut buf) {
                    Ok(0) | Err(_) => return None,
                    Ok(n) => reader.push(&buf[..n]),
                }
            }
            Err(e) => panic!("the client sent garbage: {e}"),
        }
    }
}

fn play(mut stream: TcpStream, script: Vec<Step>) {
    let mut reader = PacketReader::new();
    for step in script {
        match step {
            Step::Expect(prefix) => {
                let Some(got) = next_request(&mut stream, &mut reader) else {
                    return;
                };
                let got = String::from_utf8_lossy(&got);
                assert!(got.starts_with(prefix), "expected `{prefix}`, got `{got}`");
            }
            Step::ExpectInterrupt => {
                let mut byte = [0u8; 1];
                loop {
                    match stream.read(&mut byte) {
                        Ok(1) if byte[0] == 0x03 => break,
                        Ok(1) => {}
                        _ => return,
                    }
                }
            }
            Step::Reply(payload) => {
                if stream.write_all(&encode(&payload)).is_err() {
                    return;
                }
            }
            Step::Raw(bytes) => {
                if stream.write_all(&bytes).is_err() {
                    return;
                }
            }
            Step::Flood(bytes) => while stream.write_all(&bytes).is_ok() {},
            Step::AnswerAll(bytes) => {
                while next_request(&mut stream, &mut reader).is_some() {
                    if stream.write_all(&bytes).is_err() {
                        return;
                    }
                }
                return;
            }
            Step::Silence => {
                let mut sink = Vec::new();
                let _ = stream.read_to_end(&mut sink);
                return;
            }
            Step::Sleep(d) => std::thread::sleep(d),
            Step::Close => return,
        }
    }
    // The script is over: hold the connection until the client hangs up, so that what the
    // client sees is what the script said, not an end of file.
    let mut sink = Vec::new();
    let _ = stream.read_to_end(&mut sink);
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::control::{ControlError, Machine, VcpuId};
    use crate::gdb::packet::{PacketError, MAX_BODY, MAX_NOISE};
    use crate::gdb::{GdbClient, GdbError, GdbMachine, StopReply};

    /// Long enough that a test passing within [`BOUND`] did not pass by timing out.
    const PATIENT: Duration = Duration::from_secs(60);
    /// Short, for the cases where the stub goes silent and the timeout is the answer.
    const IMPATIENT: Duration = Duration::from_millis(300);
    /// Every case ends within this (generous: a loaded CI machine).
    const BOUND: Duration = Duration::from_secs(10);

    fn script(tail: Vec<Step>) -> Vec<Step> {
        handshake().into_iter().chain(tail).collect()
    }

    fn connected(tail: Vec<Step>, timeout: Duration) -> (GdbClient, FakeStub) {
        let stub = FakeStub::start(script(tail));
        let client = GdbClient::connect(&stub.addr, timeout).unwrap();
        (client, stub)
    }

    /// Runs `f`, asserting that it ends within [`BOUND`].
    fn bounded<T>(f: impl FnOnce() -> T) -> T {
        let started = Instant::now();
        let out = f();
        let took = started.elapsed();
        assert!(took < BOUND, "took {took:?}");
        out
    }

    fn memory_error(tail: Vec<Step>) -> GdbError {
        let (mut client, stub) = connected(tail, PATIENT);
        let mut buf = [0u8; 4];
        let err = bounded(|| client.read_memory(0x1000, &mut buf)).unwrap_err();
        drop(client);
        stub.finish();
        err
    }

    #[test]
    fn well_formed_stub_answers_a_memory_read() {
        let (mut client, stub) =
            connected(vec![Step::Expect("m1000,4"), reply("deadbeef")], PATIENT);
        let mut buf = [0u8; 4];

        client.read_memory(0x1000, &mut buf).unwrap();

        assert_eq!(buf, [0xde, 0xad, 0xbe, 0xef]);
        drop(client);
        stub.finish();
    }

    #[test]
    fn batched_writes_go_out_in_order_and_each_answer_is_read() {
        let (mut client, stub) = connected(
            vec![
                Step::Expect("M1000,2:abcd"),
                Step::Expect("M2000,1:ef"),
                Step::Expect("M3000,1:01"),
                reply("OK"),
                reply("OK"),
                reply("OK"),
                Step::Expect("m4000,1"),
                reply("5a"),
            ],
            PATIENT,
        );
        let before = client.packets();

        bounded(|| {
            client.write_memory_batch(&[(0x1000, &[0xab, 0xcd]), (0x2000, &[0xef]), (0x3000, &[1])])
        })
        .unwrap();
        let mut buf = [0u8; 1];
        client.read_memory(0x4000, &mut buf).unwrap();

        // The stub read all three requests before answering any: they were pipelined.
        assert_eq!(client.packets() - before, 4);
        assert_eq!(buf, [0x5a]);
        drop(client);
        stub.finish();
    }

    #[test]
    fn a_refused_write_in_a_batch_names_its_index_and_leaves_the_stream_in_step() {
        let (mut client, stub) = connected(
            vec![
                Step::Expect("M1000,1:01"),
                Step::Expect("M2000,1:02"),
                Step::Expect("M3000,1:03"),
                reply("OK"),
                reply("E14"),
                reply("OK"),
                Step::Expect("m4000,1"),
                reply("5a"),
            ],
            PATIENT,
        );

        let (index, err) = bounded(|| {
            client.write_memory_batch(&[(0x1000, &[1]), (0x2000, &[2]), (0x3000, &[3])])
        })
        .unwrap_err();
        let mut buf = [0u8; 1];
        client.read_memory(0x4000, &mut buf).unwrap();

        assert_eq!(index, 1);
        assert!(matches!(err, GdbError::Refused { .. }), "{err:?}");
        // The answers to the rest of the window were read: the next request gets its own.
        assert_eq!(buf, [0x5a]);
        drop(client);
        stub.finish();
    }

    #[test]
    fn connecting_to_a_closed_port_is_a_connect_error() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = format!("tcp:{}", listener.local_addr().unwrap());
        drop(listener);

        let err = bounded(|| GdbClient::connect(&addr, PATIENT)).unwrap_err();

        assert!(matches!(err, GdbError::Connect { .. }), "{err}");
    }

    #[test]
    fn stub_that_never_answers_the_handshake_times_out() {
        let stub = FakeStub::start(vec![Step::Silence]);

        let err = bounded(|| GdbClient::connect(&stub.addr, IMPATIENT)).unwrap_err();

        assert!(matches!(err, GdbError::Timeout { .. }), "{err}");
        assert!(err.to_string().contains("qSupported"), "{err}");
        stub.finish();
    }

    #[test]
    fn stub_that_stops_answering_mid_session_times_out() {
        let (mut client, stub) = connected(vec![Step::Silence], IMPATIENT);
        let mut buf = [0u8; 4];

        let err = bounded(|| client.read_memory(0x1000, &mut buf)).unwrap_err();

        assert!(matches!(err, GdbError::Timeout { .. }), "{err}");
        drop(client);
        stub.finish();
    }

    #[test]
    fn stub_that_closes_mid_packet_is_a_closed_connection() {
        let err = memory_error(vec![Step::Expect("m"), raw("$dead"), Step::Close]);

        assert!(matches!(err, GdbError::Closed), "{err}");
    }

    #[test]
    fn stub_that_closes_before_answering_is_a_closed_connection() {
        let err = memory_error(vec![Step::Expect("m"), Step::Close]);

        assert!(matches!(err, GdbError::Closed), "{err}");
    }

    #[test]
    fn endless_packet_without_end_marker_is_refused_without_waiting_for_the_timeout() {
        let err = memory_error(vec![
            Step::Expect("m"),
            raw("$"),
            Step::Flood(vec![b'a'; 4096]),
        ]);

        assert!(
            matches!(
                err,
                GdbError::Packet {
                    source: PacketError::TooLong { limit: MAX_BODY },
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn endless_garbage_is_refused_without_waiting_for_the_timeout() {
        let err = memory_error(vec![Step::Expect("m"), Step::Flood(vec![b'z'; 4096])]);

        assert!(
            matches!(&err, GdbError::Packet { source: PacketError::Noise { bytes }, .. } if *bytes > MAX_NOISE),
            "{err}"
        );
    }

    #[test]
    fn huge_run_length_expansion_is_refused() {
        let mut body = b"0".to_vec();
        for _ in 0..4000 {
            body.extend_from_slice(b"*~");
        }
        let sum = body.iter().fold(0u8, |a, b| a.wrapping_add(*b));
        let mut packet = b"$".to_vec();
        packet.extend_from_slice(&body);
        packet.extend_from_slice(format!("#{sum:02x}").as_bytes());

        let err = memory_error(vec![Step::Expect("m"), Step::Raw(packet)]);

        assert!(
            matches!(
                err,
                GdbError::Packet {
                    source: PacketError::TooLarge { .. },
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn bad_checksum_without_acks_is_an_error_at_once() {
        let err = memory_error(vec![Step::Expect("m"), raw("$deadbeef#00")]);

        assert!(
            matches!(
                err,
                GdbError::Packet {
                    source: PacketError::Checksum { .. },
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn bad_checksum_forever_with_acks_gives_up_after_a_few_retries() {
        let stub = FakeStub::start(
            handshake_with_acks()
                .into_iter()
                .chain([Step::Expect("m"), Step::Flood(b"$deadbeef#00".to_vec())])
                .collect(),
        );
        let mut client = GdbClient::connect(&stub.addr, PATIENT).unwrap();
        let mut buf = [0u8; 4];

        let err = bounded(|| client.read_memory(0x1000, &mut buf)).unwrap_err();

        assert!(
            matches!(
                err,
                GdbError::Packet {
                    source: PacketError::Checksum { .. },
                    ..
                }
            ),
            "{err}"
        );
        drop(client);
        stub.finish();
    }

    /// Connects in ack mode to a stub whose handshake is `handshake` and then `tail`.
    fn connected_with_acks(handshake: Vec<Step>, tail: Vec<Step>) -> (GdbClient, FakeStub) {
        let stub = FakeStub::start(handshake.into_iter().chain(tail).collect());
        let client = GdbClient::connect(&stub.addr, PATIENT).unwrap();
        (client, stub)
    }

    #[test]
    fn with_acks_qemu_takes_batched_writes_pipelined() {
        // QEMU before 8.0 keeps acks on; it acks each request (`+`) and answers it, and
        // reads the next `$` while its answer waits for the client's ack.
        let (mut client, stub) = connected_with_acks(
            handshake_with_acks(),
            vec![
                Step::Expect("M1000,1:01"),
                Step::Expect("M2000,1:02"),
                raw("+"),
                reply("OK"),
                raw("+"),
                reply("OK"),
                Step::Expect("m3000,1"),
                raw("+"),
                reply("5a"),
            ],
        );
        let before = client.packets();

        bounded(|| client.write_memory_batch(&[(0x1000, &[1]), (0x2000, &[2])])).unwrap();
        let mut buf = [0u8; 1];
        client.read_memory(0x3000, &mut buf).unwrap();

        // The stub read both writes before answering either.
        assert_eq!(client.packets() - before, 3);
        assert_eq!(buf, [0x5a]);
        drop(client);
        stub.finish();
    }

    /// `n` bytes counting up from `first`, and their hex.
    fn counting(first: u8, n: usize) -> (Vec<u8>, String) {
        let bytes: Vec<u8> = (0..n).map(|i| first.wrapping_add(i as u8)).collect();
        let hex = bytes.iter().map(|b| format!("{b:02x}")).collect();
        (bytes, hex)
    }

    #[test]
    fn with_acks_qemu_answers_the_chunks_of_a_long_read_pipelined() {
        // PacketSize 0x1000: 2,032 bytes a chunk, so 3,000 bytes are two requests, both
        // read by the stub before it answers either.
        let (first, first_hex) = counting(0, 2032);
        let (second, second_hex) = counting(7, 968);
        let (mut client, stub) = connected_with_acks(
            handshake_with_acks(),
            vec![
                Step::Expect("m1000,7f0"),
                Step::Expect("m17f0,3c8"),
                raw("+"),
                reply(&first_hex),
                raw("+"),
                reply(&second_hex),
            ],
        );
        let mut buf = vec![0u8; 3000];

        bounded(|| client.read_memory(0x1000, &mut buf)).unwrap();

        assert_eq!(&buf[..2032], &first[..]);
        assert_eq!(&buf[2032..], &second[..]);
        drop(client);
        stub.finish();
    }

    #[test]
    fn a_short_answer_in_a_pipelined_read_goes_on_from_where_it_ended() {
        // The first chunk comes back with 16 bytes only: the window's other answer is read
        // and dropped, and the read goes on at 0x1010, one request at a time.
        let (head, head_hex) = counting(1, 16);
        let (_, dropped_hex) = counting(0, 968);
        let (rest1, rest1_hex) = counting(50, 2032);
        let (rest2, rest2_hex) = counting(9, 952);
        let (mut client, stub) = connected_with_acks(
            handshake_with_acks(),
            vec![
                Step::Expect("m1000,7f0"),
                Step::Expect("m17f0,3c8"),
                reply(&head_hex),
                reply(&dropped_hex),
                Step::Expect("m1010,7f0"),
                reply(&rest1_hex),
                Step::Expect("m1800,3b8"),
                reply(&rest2_hex),
            ],
        );
        let mut buf = vec![0u8; 3000];

        bounded(|| client.read_memory(0x1000, &mut buf)).unwrap();

        assert_eq!(&buf[..16], &head[..]);
        assert_eq!(&buf[16..2048], &rest1[..]);
        assert_eq!(&buf[2048..], &rest2[..]);
        drop(client);
        stub.finish();
    }

    #[test]
    fn with_acks_a_stub_that_is_not_qemu_gets_one_write_at_a_time() {
        let not_qemu = vec![
            Step::Expect("qSupported"),
            reply("PacketSize=1000"),
            Step::Expect("Qqemu.PhyMemMode:0"),
            reply(""),
        ];
        let (mut client, stub) = connected_with_acks(
            not_qemu,
            vec![
                Step::Expect("M1000,1:01"),
                reply("OK"),
                Step::Expect("M2000,1:02"),
                reply("OK"),
            ],
        );

        bounded(|| client.write_memory_batch(&[(0x1000, &[1]), (0x2000, &[2])])).unwrap();

        drop(client);
        stub.finish();
    }

    #[test]
    fn with_acks_a_nak_inside_a_pipelined_window_is_an_error_not_a_mismatch() {
        // A `-` says a request arrived corrupt and was dropped: the answers after it would
        // pair with the wrong requests, so the batch stops there.
        let (mut client, stub) = connected_with_acks(
            handshake_with_acks(),
            vec![
                Step::Expect("M1000,1:01"),
                Step::Expect("M2000,1:02"),
                raw("+"),
                reply("OK"),
                raw("-"),
            ],
        );

        let (index, err) =
            bounded(|| client.write_memory_batch(&[(0x1000, &[1]), (0x2000, &[2])])).unwrap_err();

        assert_eq!(index, 1);
        assert!(matches!(err, GdbError::Rejected { .. }), "{err}");
        drop(client);
        stub.finish();
    }

    #[test]
    fn one_bad_checksum_with_acks_is_asked_for_again() {
        let stub = FakeStub::start(
            handshake_with_acks()
                .into_iter()
                .chain([
                    Step::Expect("m"),
                    raw("$deadbeef#00"),
                    Step::Sleep(Duration::from_millis(50)),
                    reply("deadbeef"),
                ])
                .collect(),
        );
        let mut client = GdbClient::connect(&stub.addr, PATIENT).unwrap();
        let mut buf = [0u8; 4];

        client.read_memory(0x1000, &mut buf).unwrap();

        assert_eq!(buf, [0xde, 0xad, 0xbe, 0xef]);
        drop(client);
        stub.finish();
    }

    #[test]
    fn stub_that_rejects_every_packet_with_acks_gives_up() {
        let stub = FakeStub::start(
            handshake_with_acks()
                .into_iter()
                .chain([Step::AnswerAll(b"-".to_vec())])
                .collect(),
        );
        let mut client = GdbClient::connect(&stub.addr, PATIENT).unwrap();
        let mut buf = [0u8; 4];

        let err = bounded(|| client.read_memory(0x1000, &mut buf)).unwrap_err();

        assert!(matches!(err, GdbError::Rejected { .. }), "{err}");
        drop(client);
        stub.finish();
    }

    #[test]
    fn endless_stop_replies_instead_of_an_answer_are_refused() {
        let err = memory_error(vec![
            Step::Expect("m"),
            Step::Flood(encode(b"T05thread:01;")),
        ]);

        assert!(matches!(err, GdbError::Unsolicited { .. }), "{err}");
    }

    #[test]
    fn memory_read_of_odd_length_hex_is_unexpected() {
        let err = memory_error(vec![Step::Expect("m"), reply("dea")]);

        assert!(matches!(err, GdbError::Unexpected { .. }), "{err}");
    }

    #[test]
    fn memory_read_longer_than_asked_is_unexpected() {
        let err = memory_error(vec![Step::Expect("m"), reply("deadbeef00")]);

        assert!(matches!(err, GdbError::Unexpected { .. }), "{err}");
    }

    #[test]
    fn memory_read_of_an_empty_answer_is_unsupported_not_a_loop() {
        let err = memory_error(vec![Step::Expect("m"), reply("")]);

        assert!(matches!(err, GdbError::Unsupported(_)), "{err}");
    }

    #[test]
    fn memory_read_of_non_hex_is_unexpected() {
        let err = memory_error(vec![Step::Expect("m"), reply("OK")]);

        assert!(matches!(err, GdbError::Unexpected { .. }), "{err}");
    }

    #[test]
    fn thread_list_that_never_ends_is_refused() {
        let (mut client, stub) = connected(
            vec![
                Step::Expect("qfThreadInfo"),
                reply("m1"),
                Step::AnswerAll(encode(b"m1")),
            ],
            PATIENT,
        );

        let err = bounded(|| client.threads()).unwrap_err();

        assert!(matches!(err, GdbError::TooLarge { .. }), "{err}");
        drop(client);
        stub.finish();
    }

    #[test]
    fn thread_list_chunk_without_a_thread_is_unexpected() {
        let (mut client, stub) = connected(
            vec![Step::Expect("qfThreadInfo"), reply("m"), Step::Silence],
            PATIENT,
        );

        let err = bounded(|| client.threads()).unwrap_err();

        assert!(matches!(err, GdbError::Unexpected { .. }), "{err}");
        drop(client);
        stub.finish();
    }

    #[test]
    fn target_description_that_never_ends_is_refused() {
        let stub = FakeStub::start(vec![
            Step::Expect("qSupported"),
            reply("PacketSize=1000;QStartNoAckMode+;qXfer:features:read+"),
            Step::Expect("QStartNoAckMode"),
            reply("OK"),
            Step::AnswerAll(encode(&[b'm'; 2000])),
        ]);

        let err = bounded(|| GdbClient::connect(&stub.addr, PATIENT)).unwrap_err();

        assert!(matches!(err, GdbError::TooLarge { .. }), "{err}");
        stub.finish();
    }

    #[test]
    fn empty_target_description_chunk_is_unexpected() {
        let stub = FakeStub::start(vec![
            Step::Expect("qSupported"),
            reply("PacketSize=1000;QStartNoAckMode+;qXfer:features:read+"),
            Step::Expect("QStartNoAckMode"),
            reply("OK"),
            Step::Expect("qXfer"),
            reply("m"),
        ]);

        let err = bounded(|| GdbClient::connect(&stub.addr, PATIENT)).unwrap_err();

        assert!(matches!(err, GdbError::Unexpected { .. }), "{err}");
        stub.finish();
    }

    #[test]
    fn stop_reply_of_the_wrong_shape_is_unexpected() {
        let (mut client, stub) = connected(vec![Step::Expect("c"), reply("OK")], PATIENT);
        client.resume().unwrap();

        let err = bounded(|| client.wait_stop(PATIENT)).unwrap_err();

        assert!(matches!(err, GdbError::Unexpected { .. }), "{err}");
        drop(client);
        stub.finish();
    }

    #[test]
    fn stub_that_dies_while_the_guest_runs_is_noticed_at_once() {
        let (mut client, stub) = connected(
            vec![
                Step::Expect("c"),
                Step::Sleep(Duration::from_millis(100)),
                Step::Close,
            ],
            PATIENT,
        );
        client.resume().unwrap();

        let err = bounded(|| client.wait_stop(Duration::from_secs(3600))).unwrap_err();

        assert!(matches!(err, GdbError::Closed), "{err}");
        drop(client);
        stub.finish();
    }

    #[test]
    fn wait_for_a_stop_is_cancelled_from_another_thread() {
        let (mut client, stub) = connected(vec![Step::Expect("c"), Step::Silence], PATIENT);
        client.resume().unwrap();
        let interrupter = client.interrupter().unwrap();
        let canceller = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            interrupter.cancel().unwrap();
        });

        let err = bounded(|| client.wait_stop(Duration::MAX)).unwrap_err();

        assert!(matches!(err, GdbError::Cancelled), "{err}");
        canceller.join().unwrap();
        drop(client);
        stub.finish();
    }

    #[test]
    fn interrupt_from_another_thread_ends_the_wait_with_the_stop() {
        let (mut client, stub) = connected(
            vec![
                Step::Expect("c"),
                Step::ExpectInterrupt,
                reply("T02thread:01;"),
            ],
            PATIENT,
        );
        client.resume().unwrap();
        let interrupter = client.interrupter().unwrap();
        let stopper = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            interrupter.interrupt().unwrap();
        });

        let stop = bounded(|| client.wait_stop(Duration::MAX)).unwrap();

        assert!(
            matches!(stop, Some(StopReply::Signal { signal: 2, .. })),
            "{stop:?}"
        );
        stopper.join().unwrap();
        drop(client);
        stub.finish();
    }

    /// QEMU's gdbstub selects the vCPU that stopped at every stop: a register access to
    /// another vCPU after the guest ran must select it again, or it reads (and writes) the
    /// vCPU that stopped. (Issue 40: the removal read one vCPU's registers twice and never
    /// saw the other parked at the return trampoline, which then ran its `ud2`.)
    #[test]
    fn a_stop_forgets_the_selected_thread() {
        let rip = "0080ffffffffffff";
        let stub = FakeStub::start(
            machine_handshake()
                .into_iter()
                .chain([
                    Step::Expect("Hg2"),
                    reply("OK"),
                    Step::Expect("p10"),
                    reply(rip),
                    Step::Expect("p10"),
                    reply(rip),
                    Step::Expect("c"),
                    reply("T05thread:01;"),
                    Step::Expect("Hg2"),
                    reply("OK"),
                    Step::Expect("p10"),
                    reply(rip),
                ])
                .collect(),
        );
        let mut machine = GdbMachine::connect(&stub.addr, PATIENT).unwrap();
        let client = machine.client();
        let other = crate::gdb::ThreadId(2);

        bounded(|| {
            // Selected once while stopped; then the guest runs and thread 1 stops.
            client.read_register(other, "rip").unwrap();
            client.read_register(other, "rip").unwrap();
            client.resume().unwrap();
            assert!(client.wait_stop(PATIENT).unwrap().is_some());
            client.read_register(other, "rip").unwrap();
        });

        drop(machine);
        stub.finish();
    }

    #[test]
    fn register_value_narrower_than_the_register_is_unexpected() {
        let stub = FakeStub::start(
            machine_handshake()
                .into_iter()
                .chain([
                    Step::Expect("Hg1"),
                    reply("OK"),
                    Step::Expect("p"),
                    reply("0011"),
                ])
                .collect(),
        );
        let mut machine = GdbMachine::connect(&stub.addr, PATIENT).unwrap();

        let err = bounded(|| {
            machine
                .client()
                .read_register(crate::gdb::ThreadId(1), "cr3")
        })
        .unwrap_err();

        assert!(matches!(err, GdbError::Unexpected { .. }), "{err}");
        drop(machine);
        stub.finish();
    }

    #[test]
    fn short_register_file_is_an_error_not_zeros() {
        let stub = FakeStub::start(
            machine_handshake()
                .into_iter()
                .chain([
                    Step::Expect("Hg1"),
                    reply("OK"),
                    Step::Expect("g"),
                    Step::Reply(vec![b'0'; 2 * (G_BYTES - 4)]),
                ])
                .collect(),
        );
        let mut machine = GdbMachine::connect(&stub.addr, PATIENT).unwrap();

        let err = bounded(|| machine.registers(VcpuId(0))).unwrap_err();

        let ControlError::Backend { source, .. } = &err else {
            panic!("{err}");
        };
        let message = source.to_string();
        assert!(message.contains("without gs"), "{message}");
        drop(machine);
        stub.finish();
    }

    #[test]
    fn full_register_file_is_read() {
        let mut g = "11".repeat(G_BYTES);
        g.replace_range(16 * 16..17 * 16, "0010000081ffffff");
        let stub = FakeStub::start(
            machine_handshake()
                .into_iter()
                .chain([
                    Step::Expect("Hg1"),
                    reply("OK"),
                    Step::Expect("g"),
                    Step::Reply(g.into_bytes()),
                    Step::AnswerAll(encode(b"0010000000000000")),
                ])
                .collect(),
        );
        let mut machine = GdbMachine::connect(&stub.addr, PATIENT).unwrap();

        let regs = machine.registers(VcpuId(0)).unwrap();

        let crate::control::RegisterFile::X86_64(regs) = regs else {
            panic!("{regs:?}");
        };
        assert_eq!(regs.rip, 0xffff_ff81_0000_1000);
        assert_eq!(regs.cr3, 0x1000);
        drop(machine);
        stub.finish();
    }

    #[test]
    fn mutated_replies_over_the_socket_end_in_an_answer_or_an_error() {
        let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
        for case in 0..300 {
            let seed = SEED_REPLIES[rng.below(SEED_REPLIES.len())];
            let payload = mutate(&mut rng, seed);
            // Half framed with a valid checksum (the parsers see it), half raw bytes.
            let bytes = if case % 2 == 0 {
                encode(&payload)
            } else {
                mutate(&mut rng, &encode(seed))
            };
            let request = ["m", "?", "qfThreadInfo", "c"][case % 4];
            let (mut client, stub) = connected(
                vec![Step::Expect(request), Step::Raw(bytes), Step::Close],
                PATIENT,
            );

            bounded(|| match request {
                "m" => client.read_memory(0x1000, &mut [0u8; 8]),
                "?" => client.stop_reason().map(|_| ()),
                "qfThreadInfo" => client.threads().map(|_| ()),
                _ => client
                    .resume()
                    .and_then(|()| client.wait_stop(PATIENT))
                    .map(|_| ()),
            })
            .ok();

            drop(client);
            stub.finish();
        }
    }
}
