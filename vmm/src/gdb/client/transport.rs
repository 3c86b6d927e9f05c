//! The connection under a [`super::GdbClient`]: a TCP or unix stream, the deadline every wait
//! ends at, and the [`Interrupter`] that ends a wait from another thread.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{short, GdbError};

pub(super) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Tcp(s) => write!(f, "Tcp({:?})", s.peer_addr().ok()),
            Self::Unix(_) => f.write_str("Unix"),
        }
    }
}

impl Stream {
    pub(super) fn set_read_timeout(&self, d: Option<Duration>) -> std::io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_read_timeout(d),
            Self::Unix(s) => s.set_read_timeout(d),
        }
    }

    pub(super) fn set_write_timeout(&self, d: Option<Duration>) -> std::io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_write_timeout(d),
            Self::Unix(s) => s.set_write_timeout(d),
        }
    }

    pub(super) fn try_clone(&self) -> std::io::Result<Self> {
        Ok(match self {
            Self::Tcp(s) => Self::Tcp(s.try_clone()?),
            Self::Unix(s) => Self::Unix(s.try_clone()?),
        })
    }

    pub(super) fn shutdown(&self, how: Shutdown) -> std::io::Result<()> {
        match self {
            Self::Tcp(s) => s.shutdown(how),
            Self::Unix(s) => s.shutdown(how),
        }
    }

    /// Writes through a shared reference (another thread's clone of the socket).
    pub(super) fn write_all_shared(&self, bytes: &[u8]) -> std::io::Result<()> {
        match self {
            Self::Tcp(s) => (&*s).write_all(bytes),
            Self::Unix(s) => (&*s).write_all(bytes),
        }
    }
}

/// When a wait ends: `None` is never (a wait longer than `Instant` can count).
#[derive(Debug, Clone, Copy)]
pub(super) struct Deadline {
    at: Option<Instant>,
    timeout: Duration,
}

impl Deadline {
    pub(super) fn after(timeout: Duration) -> Self {
        Self {
            at: Instant::now().checked_add(timeout),
            timeout,
        }
    }

    /// Time left; `Some(ZERO)` once passed, `None` for no limit.
    pub(super) fn left(&self) -> Option<Duration> {
        self.at
            .map(|at| at.saturating_duration_since(Instant::now()))
    }

    pub(super) fn timeout_error(&self, what: &str) -> GdbError {
        GdbError::Timeout {
            what: short(what),
            secs: self.timeout.as_secs_f64(),
        }
    }
}

/// Ends a wait of a [`GdbClient`](super::GdbClient) from another thread, such as a Ctrl-C
/// handler: while the client waits for the target to stop, [`Self::interrupt`] stops the
/// target (the wait then returns its stop reply) and [`Self::cancel`] abandons the wait.
#[derive(Debug)]
pub struct Interrupter {
    pub(super) stream: Stream,
    pub(super) cancelled: Arc<AtomicBool>,
}

impl Interrupter {
    /// Sends the interrupt byte (`0x03`): the stub stops all vCPUs and answers the waiting
    /// client with a stop reply. Only while the target runs: at other times the byte could
    /// land inside a packet the client is sending.
    ///
    /// # Errors
    /// When the connection is gone.
    pub fn interrupt(&self) -> Result<(), GdbError> {
        self.stream
            .write_all_shared(&[0x03])
            .map_err(GdbError::from)
    }

    /// Makes the client's current wait, and every later one, return
    /// [`GdbError::Cancelled`] at once; the connection is unusable afterwards.
    ///
    /// # Errors
    /// When the socket cannot be shut down.
    pub fn cancel(&self) -> Result<(), GdbError> {
        self.cancelled.store(true, Ordering::SeqCst);
        match self.stream.shutdown(Shutdown::Read) {
            Err(e) if e.kind() != std::io::ErrorKind::NotConnected => Err(GdbError::Io(e)),
            _ => Ok(()),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Self::Tcp(s) => s.read(buf),
            Self::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write(buf),
            Self::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Self::Tcp(s) => s.flush(),
            Self::Unix(s) => s.flush(),
        }
    }
}

/// Connects to the first address of `hostport` that answers within `timeout` each.
pub(super) fn connect_tcp(hostport: &str, timeout: Duration) -> std::io::Result<TcpStream> {
    let mut last = None;
    for addr in hostport.to_socket_addrs()? {
        match TcpStream::connect_timeout(&addr, timeout) {
            Ok(stream) => return Ok(stream),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::NotFound, "the name has no address")
    }))
}
