//! A GDB remote protocol client for QEMU's gdbstub.
//!
//! Hand-written because the maintained Rust crates for this protocol (`gdbstub`) implement the
//! *server* side; a client needs the opposite half: framing and acks, stop replies, target
//! descriptions and QEMU's extensions (`Qqemu.PhyMemMode` for physical memory).
//!
//! All-stop only. The peer is not trusted: every wait (connect, request, ack, write) ends at a
//! deadline with [`GdbError::Timeout`]; a peer that hangs up gives [`GdbError::Closed`] at
//! once, even during a long wait for a stop; garbage (endless or oversized packets, noise,
//! checksums that never match, floods of unsolicited packets, answers of the wrong shape)
//! gives an error as soon as it is seen, within bounded memory (see [`super::packet`]). A
//! wait for a stop can be ended from another thread with an [`Interrupter`].

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::packet::{self, from_hex, to_hex, Frame, PacketError, PacketReader};
use super::target::{self, RegisterInfo, TargetError};

mod memory;
mod transport;

pub use transport::Interrupter;
use transport::{connect_tcp, Deadline, Stream};

/// Corrupt packets (or requests for a retransmission) in a row before giving up.
const MAX_RETRIES: usize = 3;
/// Packets that do not answer a request (stop replies, console output) skipped while
/// waiting for its answer.
const MAX_UNSOLICITED: usize = 64;
/// Bytes of framed `M` requests sent before their answers are read when writes are
/// pipelined ([`GdbClient::write_memory_batch`]): QEMU reads 4 KiB at a time and answers
/// each with 6 bytes, so neither side fills a socket buffer and blocks the other.
const PIPELINE_WINDOW: usize = 32 << 10;
/// Read requests in flight at once ([`GdbClient::read_memory`]): their answers (up to a
/// packet each) wait in the socket until read, so a window's answers stay within what the
/// stub can write without blocking on a full socket for long.
const READ_WINDOW: usize = 32;
/// Bytes of console output kept from one monitor command.
const MAX_CONSOLE: usize = 1 << 20;
/// Bytes of one `qXfer` object (QEMU's x86-64 target description is about 10 KiB).
const MAX_XFER: usize = 1 << 20;
/// Files one target description may include.
const MAX_INCLUDES: usize = 64;
/// Threads (vCPUs) one stub may list.
const MAX_THREADS: usize = 4096;

/// Errors of the GDB client.
#[derive(Debug, thiserror::Error)]
pub enum GdbError {
    /// Connecting failed.
    #[error("cannot connect to the gdbstub at {addr}")]
    Connect {
        /// The address.
        addr: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The connection failed.
    #[error("the gdbstub connection failed")]
    Io(#[source] std::io::Error),
    /// The stub closed the connection.
    #[error("the gdbstub closed the connection")]
    Closed,
    /// No answer in time.
    #[error("no answer from the gdbstub within {secs:.1} s while waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// The timeout.
        secs: f64,
    },
    /// Packets were malformed, or the stream holds garbage instead of packets.
    #[error("malformed data from the gdbstub while waiting for {what}")]
    Packet {
        /// What was awaited.
        what: String,
        /// The last fault.
        #[source]
        source: PacketError,
    },
    /// The stub kept asking for our packet again.
    #[error("the gdbstub rejected `{what}` {count} times (it receives corrupt packets)")]
    Rejected {
        /// The request (truncated).
        what: String,
        /// How often.
        count: usize,
    },
    /// The stub sent packets that answer nothing, without end.
    #[error("the gdbstub sent {count} packets that do not answer `{what}`")]
    Unsolicited {
        /// The request (truncated).
        what: String,
        /// How many.
        count: usize,
    },
    /// An answer made of many packets does not end.
    #[error("the gdbstub's answer to `{what}` exceeds {limit}")]
    TooLarge {
        /// The request (truncated).
        what: String,
        /// The limit, with its unit.
        limit: String,
    },
    /// Another thread cancelled the wait ([`Interrupter::cancel`]).
    #[error("waiting for the gdbstub was cancelled")]
    Cancelled,
    /// The stub answered `Exx`.
    #[error("the gdbstub refused `{request}` with error {code}")]
    Refused {
        /// The request (truncated).
        request: String,
        /// The error code.
        code: String,
    },
    /// The stub does not support a request.
    #[error("the gdbstub does not support `{0}`")]
    Unsupported(String),
    /// The answer does not fit the request.
    #[error("unexpected answer to `{request}`: `{reply}`")]
    Unexpected {
        /// The request (truncated).
        request: String,
        /// The reply (truncated).
        reply: String,
    },
    /// The target description is unusable.
    #[error("the gdbstub's target description is unusable")]
    Target(#[from] TargetError),
    /// A register is unknown.
    #[error("the target has no register named {0}")]
    NoRegister(String),
}

impl From<std::io::Error> for GdbError {
    /// A peer that hung up (QEMU exited) is [`GdbError::Closed`], not an I/O failure.
    fn from(e: std::io::Error) -> Self {
        use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
        match e.kind() {
            BrokenPipe | ConnectionReset | ConnectionAborted | UnexpectedEof => Self::Closed,
            _ => Self::Io(e),
        }
    }
}

/// A thread as the stub numbers it (QEMU: one per vCPU, from 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ThreadId(pub u64);

/// Why the target stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReply {
    /// `S`/`T`: stopped with a signal (5 = trap: breakpoint or step; 2 = interrupt).
    Signal {
        /// The signal number.
        signal: u8,
        /// The thread that stopped, when given.
        thread: Option<ThreadId>,
        /// Other `key:value` pairs (e.g. `swbreak`, `watch`).
        info: Vec<(String, String)>,
    },
    /// `W`: the target exited.
    Exited(u8),
    /// `X`: the target was terminated by a signal.
    Terminated(u8),
}

/// Parses a stop reply packet.
pub fn parse_stop_reply(reply: &str) -> Option<StopReply> {
    let kind = reply.chars().next()?;
    let rest = reply.get(1..)?;
    let code = |s: &str| u8::from_str_radix(s.get(..2)?, 16).ok();
    match kind {
        'S' => Some(StopReply::Signal {
            signal: code(rest)?,
            thread: None,
            info: Vec::new(),
        }),
        'T' => {
            let signal = code(rest)?;
            let mut thread = None;
            let mut info = Vec::new();
            for pair in rest.get(2..)?.split(';').filter(|p| !p.is_empty()) {
                let (k, v) = pair.split_once(':').unwrap_or((pair, ""));
                if k == "thread" {
                    thread = parse_thread_id(v);
                } else {
                    info.push((k.to_owned(), v.to_owned()));
                }
            }
            Some(StopReply::Signal {
                signal,
                thread,
                info,
            })
        }
        'W' => code(rest).map(StopReply::Exited),
        'X' => code(rest).map(StopReply::Terminated),
        _ => None,
    }
}

/// Whether a packet is a stop reply (`Sxx`, `Txx...`, `Wxx`, `Xxx`).
fn is_stop_reply(reply: &[u8]) -> bool {
    let hex2 = reply
        .get(1..3)
        .is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit));
    match reply.first() {
        Some(b'S' | b'W') => hex2 && reply.len() == 3,
        Some(b'X') => hex2 && (reply.len() == 3 || reply.get(3) == Some(&b';')),
        Some(b'T') => hex2,
        _ => false,
    }
}

/// Whether a packet is `O` followed by hex-encoded console text.
fn is_console_output(reply: &[u8]) -> bool {
    reply.len() > 1 && reply[0] == b'O' && reply[1..].iter().all(u8::is_ascii_hexdigit)
}

/// Parses `1a` or `p1.1a` (multiprocess syntax) into a thread id.
pub fn parse_thread_id(text: &str) -> Option<ThreadId> {
    let tid = text.rsplit('.').next()?;
    u64::from_str_radix(tid, 16).ok().map(ThreadId)
}

/// A connection to a gdbstub.
pub struct GdbClient {
    stream: Stream,
    reader: PacketReader,
    /// The last packet sent, framed, for a retransmission the stub asks for.
    last_sent: Vec<u8>,
    cancelled: Arc<AtomicBool>,
    ack_mode: bool,
    timeout: Duration,
    /// The stub's maximum packet size (`PacketSize`).
    packet_size: usize,
    features: Vec<String>,
    /// The thread the stub's `Hg` selects, as far as this client knows. QEMU's gdbstub
    /// selects the vCPU that stopped at every stop (`gdb_set_stop_cpu` sets its `g_cpu`),
    /// so the target running forgets it ([`GdbClient::resume`], [`GdbClient::step`]).
    general_thread: Option<ThreadId>,
    phys_mode: bool,
    /// The stub takes a new packet before its last answer is acked, as QEMU's gdbstub does
    /// in system mode (a `$` drops the answer it kept for a retransmission), so requests can
    /// be pipelined with acks on. QEMU before 8.0 never turns acks off.
    pipelines_with_acks: bool,
    /// Reading the answers of a pipelined window: no `+` per answer (one at the window's
    /// end), and a `-` is an error (the answers would no longer pair with the requests).
    pipelining: bool,
    registers: Vec<RegisterInfo>,
    /// Packets sent since connecting (requests, not acks).
    packets: u64,
}

impl std::fmt::Debug for GdbClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GdbClient")
            .field("packet_size", &self.packet_size)
            .field("ack_mode", &self.ack_mode)
            .field("registers", &self.registers.len())
            .finish_non_exhaustive()
    }
}

fn short(s: &str) -> String {
    s.chars().take(80).collect()
}

/// A reply as text; `Exx` is [`GdbError::Refused`] and an empty reply
/// [`GdbError::Unsupported`].
fn reply_text(request: &str, reply: &[u8]) -> Result<String, GdbError> {
    let text = String::from_utf8_lossy(reply).into_owned();
    if text.is_empty() {
        return Err(GdbError::Unsupported(short(request)));
    }
    if text.len() == 3 && text.starts_with('E') && text[1..].bytes().all(|b| b.is_ascii_hexdigit())
    {
        return Err(GdbError::Refused {
            request: short(request),
            code: text,
        });
    }
    Ok(text)
}

/// Whether a reply (as text) is `OK`.
fn ok_reply(request: &str, reply: &str) -> Result<(), GdbError> {
    if reply == "OK" {
        Ok(())
    } else {
        Err(GdbError::Unexpected {
            request: short(request),
            reply: short(reply),
        })
    }
}

impl GdbClient {
    /// Connects to `tcp:HOST:PORT`, `HOST:PORT` or `unix:PATH`, negotiates features, turns
    /// acks off where supported and reads the target description. Each step (the TCP
    /// connect, each request of the handshake) waits at most `timeout`, and so does every
    /// later request and write.
    ///
    /// # Errors
    /// When the connection or the handshake fails.
    pub fn connect(addr: &str, timeout: Duration) -> Result<Self, GdbError> {
        let connect_err = |source| GdbError::Connect {
            addr: addr.to_owned(),
            source,
        };
        // Zero would mean "no timeout" to the socket calls below.
        let io_timeout = timeout.max(Duration::from_millis(1));
        let stream = if let Some(path) = addr.strip_prefix("unix:") {
            Stream::Unix(UnixStream::connect(Path::new(path)).map_err(connect_err)?)
        } else {
            let hostport = addr.strip_prefix("tcp:").unwrap_or(addr);
            let tcp = connect_tcp(hostport, io_timeout).map_err(connect_err)?;
            tcp.set_nodelay(true).map_err(connect_err)?;
            Stream::Tcp(tcp)
        };
        // A stub that stops reading would otherwise block a write forever.
        stream
            .set_write_timeout(Some(io_timeout))
            .map_err(connect_err)?;
        let mut client = Self {
            stream,
            reader: PacketReader::new(),
            last_sent: Vec::new(),
            cancelled: Arc::new(AtomicBool::new(false)),
            ack_mode: true,
            timeout,
            packet_size: 1024,
            features: Vec::new(),
            general_thread: None,
            phys_mode: false,
            pipelines_with_acks: false,
            pipelining: false,
            registers: Vec::new(),
            packets: 0,
        };
        client.handshake()?;
        Ok(client)
    }

    fn handshake(&mut self) -> Result<(), GdbError> {
        let reply =
            self.request("qSupported:swbreak+;hwbreak+;vContSupported+;xmlRegisters=i386")?;
        self.features = reply.split(';').map(str::to_owned).collect();
        if let Some(size) = self
            .features
            .iter()
            .find_map(|f| f.strip_prefix("PacketSize="))
            .and_then(|s| usize::from_str_radix(s, 16).ok())
        {
            self.packet_size = size.clamp(64, packet::MAX_BODY);
        }
        if self.supports("QStartNoAckMode") && self.request("QStartNoAckMode")? == "OK" {
            self.ack_mode = false;
        }
        if self.supports("qXfer:features:read") {
            self.load_target_description()?;
        }
        // QEMU keeps the memory mode across connections: start from a known state.
        self.phys_mode = true;
        if self.set_physical_mode(false).is_err() {
            self.phys_mode = false;
        } else {
            // Only QEMU answers `Qqemu.PhyMemMode`: its gdbstub (system mode) reads a `$`
            // while an answer waits for its ack as the start of the next request.
            self.pipelines_with_acks = true;
        }
        Ok(())
    }

    /// Whether the stub announced `feature+` (or `feature=...`).
    pub fn supports(&self, feature: &str) -> bool {
        self.features.iter().any(|f| {
            f.strip_suffix('+') == Some(feature)
                || f.split_once('=').is_some_and(|(k, _)| k == feature)
        })
    }

    /// The registers of the target description, in number order.
    pub fn registers(&self) -> &[RegisterInfo] {
        &self.registers
    }

    /// The stub's maximum packet size.
    pub fn packet_size(&self) -> usize {
        self.packet_size
    }

    /// A handle that stops the target or cancels a wait of this client from another thread.
    ///
    /// # Errors
    /// When the socket cannot be shared.
    pub fn interrupter(&self) -> Result<Interrupter, GdbError> {
        Ok(Interrupter {
            stream: self.stream.try_clone().map_err(GdbError::Io)?,
            cancelled: Arc::clone(&self.cancelled),
        })
    }

    fn load_target_description(&mut self) -> Result<(), GdbError> {
        let top = self.read_xfer("features", "target.xml")?;
        let mut regs = Vec::new();
        target::collect_registers(&top, &mut regs)?;
        let includes = target::includes(&top)?;
        if includes.len() > MAX_INCLUDES {
            return Err(GdbError::TooLarge {
                what: "qXfer:features:read:target.xml".into(),
                limit: format!("{MAX_INCLUDES} included files"),
            });
        }
        for file in includes {
            let xml = self.read_xfer("features", &file)?;
            target::collect_registers(&xml, &mut regs)?;
        }
        regs.sort_by_key(|r| r.regnum);
        self.registers = regs;
        Ok(())
    }

    fn read_xfer(&mut self, object: &str, annex: &str) -> Result<String, GdbError> {
        let mut out = Vec::new();
        let chunk = self.packet_size.saturating_sub(32).max(64);
        loop {
            let request = format!("qXfer:{object}:read:{annex}:{:x},{chunk:x}", out.len());
            let reply = self.request_bytes(request.as_bytes())?;
            match reply.first() {
                Some(b'l') => {
                    out.extend_from_slice(&reply[1..]);
                    break;
                }
                // An empty `m` chunk would ask for the same offset forever.
                Some(b'm') if reply.len() > 1 => out.extend_from_slice(&reply[1..]),
                _ => {
                    return Err(GdbError::Unexpected {
                        request,
                        reply: short(&String::from_utf8_lossy(&reply)),
                    })
                }
            }
            if out.len() > MAX_XFER {
                return Err(GdbError::TooLarge {
                    what: short(&request),
                    limit: format!("{MAX_XFER} bytes"),
                });
            }
        }
        Ok(String::from_utf8_lossy(&out).into_owned())
    }

    /// Packets sent since connecting (requests and resumes; not acks).
    pub fn packets(&self) -> u64 {
        self.packets
    }

    fn send(&mut self, payload: &[u8]) -> Result<(), GdbError> {
        tracing::trace!(packet = %String::from_utf8_lossy(payload), "gdb send");
        self.packets += 1;
        let framed = packet::encode(payload);
        let sent = self.write_raw(&framed, payload);
        self.last_sent = framed;
        sent
    }

    /// Writes bytes; a stub that does not take them within the write timeout is a
    /// [`GdbError::Timeout`].
    fn write_raw(&mut self, bytes: &[u8], what: &[u8]) -> Result<(), GdbError> {
        let result = self
            .stream
            .write_all(bytes)
            .and_then(|()| self.stream.flush());
        match result {
            Ok(()) => Ok(()),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                Err(GdbError::Timeout {
                    what: format!(
                        "the gdbstub to take `{}`",
                        short(&String::from_utf8_lossy(what))
                    ),
                    secs: self.timeout.as_secs_f64(),
                })
            }
            Err(e) => Err(self.io_error(e)),
        }
    }

    /// An I/O error, or [`GdbError::Cancelled`] when another thread cancelled the wait.
    fn io_error(&self, e: std::io::Error) -> GdbError {
        if self.cancelled.load(Ordering::SeqCst) {
            GdbError::Cancelled
        } else {
            e.into()
        }
    }

    /// Reads one packet's payload before `deadline`, acking in ack mode and asking again
    /// (a bounded number of times) for corrupt ones.
    fn receive(&mut self, deadline: &Deadline, what: &str) -> Result<Vec<u8>, GdbError> {
        let mut corrupt = 0;
        let mut naks = 0;
        loop {
            let frame = self
                .reader
                .next_frame()
                .map_err(|source| GdbError::Packet {
                    what: short(what),
                    source,
                })?;
            match frame {
                Some(Frame::Packet(payload)) => {
                    tracing::trace!(packet = %String::from_utf8_lossy(&payload), "gdb recv");
                    if self.ack_mode && !self.pipelining {
                        self.write_raw(b"+", b"+")?;
                    }
                    return Ok(payload);
                }
                Some(Frame::Corrupt(e)) => {
                    corrupt += 1;
                    if !self.ack_mode || corrupt > MAX_RETRIES {
                        return Err(GdbError::Packet {
                            what: short(what),
                            source: e,
                        });
                    }
                    tracing::debug!("bad packet from the stub ({e}); asking for it again");
                    self.write_raw(b"-", b"-")?;
                }
                // Outside ack mode a `-` is line noise.
                Some(Frame::Nak) if !self.ack_mode => {}
                // The stub dropped one of the pipelined requests: the answers after it
                // would pair with the wrong requests.
                Some(Frame::Nak) if self.pipelining => {
                    return Err(GdbError::Rejected {
                        what: short(what),
                        count: 1,
                    });
                }
                Some(Frame::Nak) if self.last_sent.is_empty() => {}
                Some(Frame::Nak) => {
                    naks += 1;
                    if naks > MAX_RETRIES {
                        return Err(GdbError::Rejected {
                            what: short(what),
                            count: naks,
                        });
                    }
                    let again = std::mem::take(&mut self.last_sent);
                    let sent = self.write_raw(&again, what.as_bytes());
                    self.last_sent = again;
                    sent?;
                }
                None => self.read_some(deadline, what)?,
            }
        }
    }

    /// Waits for bytes from the stub until `deadline`.
    fn read_some(&mut self, deadline: &Deadline, what: &str) -> Result<(), GdbError> {
        loop {
            if self.cancelled.load(Ordering::SeqCst) {
                return Err(GdbError::Cancelled);
            }
            let left = deadline.left();
            if left.is_some_and(|d| d.is_zero()) {
                return Err(deadline.timeout_error(what));
            }
            self.stream.set_read_timeout(left).map_err(GdbError::Io)?;
            let mut buf = [0u8; 4096];
            match self.stream.read(&mut buf) {
                Ok(0) if self.cancelled.load(Ordering::SeqCst) => return Err(GdbError::Cancelled),
                Ok(0) => return Err(GdbError::Closed),
                Ok(n) => {
                    self.reader.push(&buf[..n]);
                    return Ok(());
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock
                            | std::io::ErrorKind::TimedOut
                            | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(self.io_error(e)),
            }
        }
    }

    fn request_bytes(&mut self, payload: &[u8]) -> Result<Vec<u8>, GdbError> {
        self.send(payload)?;
        let what = String::from_utf8_lossy(payload).into_owned();
        let wants_stop = payload.first() == Some(&b'?');
        // One deadline for the answer, however many other packets come first.
        let deadline = Deadline::after(self.timeout);
        self.answer(&deadline, &what, wants_stop)
    }

    /// The answer to the request `what`, skipping what answers nothing: stop replies
    /// (unless `wants_stop`) and console output.
    fn answer(
        &mut self,
        deadline: &Deadline,
        what: &str,
        wants_stop: bool,
    ) -> Result<Vec<u8>, GdbError> {
        let mut skipped = 0;
        loop {
            let reply = self.receive(deadline, what)?;
            // QEMU sends a stop reply by itself when a client connects (it stops the VM then);
            // no other request is ever answered by one, so keep it aside and read on.
            // Console output (`O` + hex) may precede the answer to monitor commands.
            let unsolicited = (!wants_stop && is_stop_reply(&reply)) || is_console_output(&reply);
            if !unsolicited {
                return Ok(reply);
            }
            tracing::debug!(reply = %short(&String::from_utf8_lossy(&reply)), "packet while waiting for `{}`", short(what));
            skipped += 1;
            if skipped > MAX_UNSOLICITED {
                return Err(GdbError::Unsolicited {
                    what: short(what),
                    count: skipped,
                });
            }
        }
    }

    /// Sends a request and returns the reply as text; `Exx` becomes [`GdbError::Refused`]
    /// and an empty reply [`GdbError::Unsupported`].
    ///
    /// # Errors
    /// Connection failures, timeouts, refusals.
    pub fn request(&mut self, payload: &str) -> Result<String, GdbError> {
        let reply = self.request_bytes(payload.as_bytes())?;
        reply_text(payload, &reply)
    }

    fn expect_ok(&mut self, payload: &str) -> Result<(), GdbError> {
        let reply = self.request(payload)?;
        ok_reply(payload, &reply)
    }

    /// Why the target is stopped (`?`).
    ///
    /// # Errors
    /// When the stub does not answer with a stop reply.
    pub fn stop_reason(&mut self) -> Result<StopReply, GdbError> {
        let reply = self.request("?")?;
        parse_stop_reply(&reply).ok_or(GdbError::Unexpected {
            request: "?".into(),
            reply: short(&reply),
        })
    }

    /// The threads (vCPUs), from `qfThreadInfo`/`qsThreadInfo`.
    ///
    /// # Errors
    /// When the stub fails.
    pub fn threads(&mut self) -> Result<Vec<ThreadId>, GdbError> {
        let mut threads = Vec::new();
        let mut reply = self.request("qfThreadInfo")?;
        while let Some(list) = reply.strip_prefix('m') {
            let before = threads.len();
            threads.extend(list.split(',').filter_map(parse_thread_id));
            // A chunk without a thread would be asked for again forever.
            if threads.len() == before {
                return Err(GdbError::Unexpected {
                    request: "qsThreadInfo".into(),
                    reply: short(&reply),
                });
            }
            if threads.len() > MAX_THREADS {
                return Err(GdbError::TooLarge {
                    what: "qsThreadInfo".into(),
                    limit: format!("{MAX_THREADS} threads"),
                });
            }
            reply = self.request("qsThreadInfo")?;
        }
        if reply != "l" {
            return Err(GdbError::Unexpected {
                request: "qsThreadInfo".into(),
                reply: short(&reply),
            });
        }
        Ok(threads)
    }

    /// Selects the thread for register and memory accesses (`Hg`).
    ///
    /// # Errors
    /// When the stub refuses.
    pub fn select_thread(&mut self, thread: ThreadId) -> Result<(), GdbError> {
        if self.general_thread != Some(thread) {
            self.expect_ok(&format!("Hg{:x}", thread.0))?;
            self.general_thread = Some(thread);
        }
        Ok(())
    }

    /// Looks up a register of the target description by name.
    ///
    /// # Errors
    /// [`GdbError::NoRegister`].
    pub fn register_info(&self, name: &str) -> Result<&RegisterInfo, GdbError> {
        self.registers
            .iter()
            .find(|r| r.name == name)
            .ok_or_else(|| GdbError::NoRegister(name.to_owned()))
    }

    /// Reads a register (by name) of `thread` as little-endian bytes.
    ///
    /// # Errors
    /// Unknown register, stub failure, a value not as wide as the register.
    pub fn read_register(&mut self, thread: ThreadId, name: &str) -> Result<Vec<u8>, GdbError> {
        let info = self.register_info(name)?;
        let (regnum, width) = (info.regnum, (info.bitsize as usize).div_ceil(8));
        self.select_thread(thread)?;
        let request = format!("p{regnum:x}");
        let reply = self.request(&request)?;
        from_hex(reply.as_bytes())
            .filter(|bytes| bytes.len() == width)
            .ok_or(GdbError::Unexpected {
                request,
                reply: short(&reply),
            })
    }

    /// Reads a register of up to 64 bits as a number.
    ///
    /// # Errors
    /// As [`Self::read_register`].
    pub fn read_register_u64(&mut self, thread: ThreadId, name: &str) -> Result<u64, GdbError> {
        let bytes = self.read_register(thread, name)?;
        let mut raw = [0u8; 8];
        for (dst, src) in raw.iter_mut().zip(&bytes) {
            *dst = *src;
        }
        Ok(u64::from_le_bytes(raw))
    }

    /// Writes a register (by name) of `thread`; `value` is little-endian and as wide as the
    /// register.
    ///
    /// # Errors
    /// Unknown register, wrong width, stub failure.
    pub fn write_register(
        &mut self,
        thread: ThreadId,
        name: &str,
        value: &[u8],
    ) -> Result<(), GdbError> {
        let info = self.register_info(name)?.clone();
        if value.len() * 8 != info.bitsize as usize {
            return Err(GdbError::Unexpected {
                request: format!("P{} ({} bytes)", name, value.len()),
                reply: format!("register is {} bits", info.bitsize),
            });
        }
        self.select_thread(thread)?;
        self.expect_ok(&format!("P{:x}={}", info.regnum, to_hex(value)))
    }

    /// Switches `m`/`M` between virtual (current thread's page tables) and physical addresses.
    ///
    /// # Errors
    /// When the stub lacks QEMU's `Qqemu.PhyMemMode`.
    pub fn set_physical_mode(&mut self, physical: bool) -> Result<(), GdbError> {
        if self.phys_mode != physical {
            self.expect_ok(&format!("Qqemu.PhyMemMode:{}", u8::from(physical)))?;
            self.phys_mode = physical;
        }
        Ok(())
    }

    /// Inserts (`true`) or removes a software breakpoint.
    ///
    /// # Errors
    /// When the stub refuses.
    pub fn set_sw_breakpoint(&mut self, addr: u64, insert: bool) -> Result<(), GdbError> {
        let op = if insert { 'Z' } else { 'z' };
        self.expect_ok(&format!("{op}0,{addr:x},1"))
    }

    /// Inserts (`Z2`/`Z4`) or removes (`z2`/`z4`) a write or access watchpoint on `len`
    /// bytes at `addr`.
    ///
    /// # Errors
    /// When the stub refuses it (an error reply, or an empty one: not supported).
    pub fn set_watchpoint(
        &mut self,
        addr: u64,
        len: u64,
        write_only: bool,
        insert: bool,
    ) -> Result<(), GdbError> {
        let op = if insert { 'Z' } else { 'z' };
        let kind = if write_only { 2 } else { 4 };
        self.expect_ok(&format!("{op}{kind},{addr:x},{len:x}"))
    }

    /// Resumes all vCPUs (all-stop `c`); the stub answers only when the target stops again.
    ///
    /// # Errors
    /// When sending fails.
    pub fn resume(&mut self) -> Result<(), GdbError> {
        // The stop that ends this run selects the vCPU that stopped: an `Hg` sent before it
        // no longer holds (a register read of another vCPU would read the one that stopped).
        self.general_thread = None;
        self.send(b"c")
    }

    /// Single-steps `thread` while the others stay stopped, and waits for the stop.
    ///
    /// # Errors
    /// When the stub fails or does not stop in time.
    pub fn step(&mut self, thread: ThreadId) -> Result<StopReply, GdbError> {
        self.general_thread = None;
        self.send(format!("vCont;s:{:x}", thread.0).as_bytes())?;
        self.wait_stop(self.timeout)?.ok_or(GdbError::Timeout {
            what: "the single step".into(),
            secs: self.timeout.as_secs_f64(),
        })
    }

    /// Stops all vCPUs (sends `\x03`) and waits for the stop reply.
    ///
    /// # Errors
    /// When the target does not stop in time.
    pub fn interrupt(&mut self) -> Result<StopReply, GdbError> {
        self.write_raw(&[0x03], b"^C")?;
        self.wait_stop(self.timeout)?.ok_or(GdbError::Timeout {
            what: "the interrupt".into(),
            secs: self.timeout.as_secs_f64(),
        })
    }

    /// Waits up to `timeout` (any length: a running guest may take hours to stop) for the
    /// running target to stop; `None` if it is still running. A stub that hangs up ends
    /// the wait at once with [`GdbError::Closed`]; [`Interrupter::cancel`] from another
    /// thread ends it with [`GdbError::Cancelled`].
    ///
    /// # Errors
    /// Connection failure, garbage, or a reply that is not a stop reply.
    pub fn wait_stop(&mut self, timeout: Duration) -> Result<Option<StopReply>, GdbError> {
        let deadline = Deadline::after(timeout);
        let mut skipped = 0;
        loop {
            let reply = match self.receive(&deadline, "a stop reply") {
                Ok(reply) => reply,
                Err(GdbError::Timeout { .. }) => return Ok(None),
                Err(e) => return Err(e),
            };
            if is_console_output(&reply) {
                skipped += 1;
                if skipped > MAX_UNSOLICITED {
                    return Err(GdbError::Unsolicited {
                        what: "(running)".into(),
                        count: skipped,
                    });
                }
                continue;
            }
            let text = String::from_utf8_lossy(&reply).into_owned();
            return parse_stop_reply(&text)
                .map(Some)
                .ok_or(GdbError::Unexpected {
                    request: "(running)".into(),
                    reply: short(&text),
                });
        }
    }

    /// Runs a QEMU monitor command (`qRcmd`) and returns what it printed.
    ///
    /// # Errors
    /// When the stub does not support monitor commands or refuses this one.
    pub fn monitor(&mut self, command: &str) -> Result<String, GdbError> {
        let request = format!("qRcmd,{}", to_hex(command.as_bytes()));
        self.send(request.as_bytes())?;
        let mut text = Vec::new();
        let mut stop_replies = 0;
        loop {
            // A long command may print for a while: each packet gets the full timeout.
            let reply = self.receive(&Deadline::after(self.timeout), &request)?;
            if is_console_output(&reply) {
                text.extend(from_hex(&reply[1..]).unwrap_or_default());
                if text.len() > MAX_CONSOLE {
                    return Err(GdbError::TooLarge {
                        what: short(&format!("monitor {command}")),
                        limit: format!("{MAX_CONSOLE} bytes of output"),
                    });
                }
                continue;
            }
            if is_stop_reply(&reply) {
                stop_replies += 1;
                if stop_replies > MAX_UNSOLICITED {
                    return Err(GdbError::Unsolicited {
                        what: short(&format!("monitor {command}")),
                        count: stop_replies,
                    });
                }
                continue;
            }
            return match reply.as_slice() {
                b"OK" => Ok(String::from_utf8_lossy(&text).into_owned()),
                b"" => Err(GdbError::Unsupported("qRcmd".into())),
                other => Err(GdbError::Refused {
                    request: short(&format!("monitor {command}")),
                    code: short(&String::from_utf8_lossy(other)),
                }),
            };
        }
    }

    /// Reads all registers with `g`: the bytes of the target description's registers in
    /// number order, as far as the stub includes them.
    ///
    /// # Errors
    /// When the stub fails.
    pub fn read_all_registers(&mut self, thread: ThreadId) -> Result<Vec<u8>, GdbError> {
        self.select_thread(thread)?;
        let reply = self.request("g")?;
        from_hex(reply.as_bytes()).ok_or(GdbError::Unexpected {
            request: "g".into(),
            reply: short(&reply),
        })
    }

    /// Detaches (`D`): removes the stub's breakpoints and lets the target run.
    ///
    /// # Errors
    /// When the stub refuses.
    pub fn detach(&mut self) -> Result<(), GdbError> {
        // Leave QEMU in virtual mode for whoever attaches next.
        if self.phys_mode {
            self.set_physical_mode(false)?;
        }
        match self.expect_ok("D") {
            // QEMU keeps the multiprocess mode a client before (gdb) asked for, and then
            // wants the process named: its one process is pid 1.
            Err(GdbError::Refused { .. }) => self.expect_ok("D;1"),
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_replies_parse() {
        assert_eq!(
            parse_stop_reply("T05thread:02;swbreak:;"),
            Some(StopReply::Signal {
                signal: 5,
                thread: Some(ThreadId(2)),
                info: vec![("swbreak".into(), String::new())]
            })
        );
        assert_eq!(
            parse_stop_reply("S02"),
            Some(StopReply::Signal {
                signal: 2,
                thread: None,
                info: vec![]
            })
        );
        assert_eq!(parse_stop_reply("W00"), Some(StopReply::Exited(0)));
        assert_eq!(parse_stop_reply("X09"), Some(StopReply::Terminated(9)));
        assert_eq!(parse_stop_reply("OK"), None);
        assert_eq!(parse_stop_reply("T"), None);
    }

    #[test]
    fn stop_replies_are_told_from_answers() {
        assert!(is_stop_reply(b"T02thread:01;"));
        assert!(is_stop_reply(b"S05"));
        assert!(!is_stop_reply(b"OK"));
        assert!(!is_stop_reply(b"PacketSize=1000"));
        assert!(!is_stop_reply(b"E14"));
        assert!(!is_stop_reply(b"l<target/>"));
        assert!(is_console_output(b"O48656c6c6f"));
        assert!(!is_console_output(b"OK"));
    }

    #[test]
    fn thread_ids_parse_in_both_syntaxes() {
        assert_eq!(parse_thread_id("1a"), Some(ThreadId(0x1a)));
        assert_eq!(parse_thread_id("p1.2"), Some(ThreadId(2)));
        assert_eq!(parse_thread_id("zz"), None);
    }

    #[test]
    fn mutated_replies_never_panic_the_reader_or_the_parsers() {
        use crate::gdb::fake_stub::{mutate, XorShift, SEED_REPLIES};
        use crate::gdb::packet::{encode, Frame, PacketReader, MAX_BODY, MAX_PAYLOAD};

        let mut rng = XorShift(0x2545_f491_4f6c_dd1d);
        let mut packets = 0usize;
        for _ in 0..20_000 {
            let seed = SEED_REPLIES[rng.below(SEED_REPLIES.len())];
            let payload = mutate(&mut rng, seed);
            let framed = encode(&payload);
            let stream = [framed.clone(), mutate(&mut rng, &framed)].concat();
            let mut reader = PacketReader::new();
            // The stream arrives in pieces of random size.
            let mut rest = stream.as_slice();
            while !rest.is_empty() {
                let (piece, tail) = rest.split_at(rng.below(rest.len()) + 1);
                rest = tail;
                reader.push(piece);
                while let Ok(Some(frame)) = reader.next_frame() {
                    if let Frame::Packet(p) = frame {
                        assert!(p.len() <= MAX_PAYLOAD);
                        packets += 1;
                        let text = String::from_utf8_lossy(&p);
                        let _ = parse_stop_reply(&text);
                        let _ = parse_thread_id(&text);
                        let _ = is_stop_reply(&p);
                        let _ = is_console_output(&p);
                        let _ = from_hex(&p);
                        let _ = target::includes(&text);
                        let _ = target::collect_registers(&text, &mut Vec::new());
                    }
                }
                assert!(reader.pending() <= MAX_BODY + 3);
            }
        }

        // At least every unmutated copy came through whole.
        assert!(packets >= 20_000, "{packets}");
    }
}
