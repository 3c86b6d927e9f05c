//! A script's procfs files, served by the host: SystemTap puts `procfs("NAME")` probes in
//! the kernel's `/proc/systemtap/MODULE/NAME`; exotap runs outside the guest, so the files are
//! on the host, where the user (or the fleet's Prometheus) reads them without entering the
//! guest.
//!
//! Two ways in, both optional and both answered by the same probes:
//! - **A directory of FIFOs** (`--procfs-dir`, by default under `$XDG_RUNTIME_DIR`): `cat
//!   DIR/NAME` runs the `.read` probe and gets its `$value`; `echo x > DIR/NAME` runs the
//!   `.write` probe with `x`. A FIFO rather than a regular file because a read must run the
//!   probe at that moment (a file's contents would be a stale copy), and a FUSE file system
//!   would need `/dev/fuse` and `fusermount` on every host. A poller notices a reader waiting
//!   (`open(O_WRONLY|O_NONBLOCK)` succeeds only then) and a writer waiting (a nonblocking
//!   read end reports "no data yet" rather than end-of-file only while one is connected).
//! - **HTTP** (`--http ADDR`, off by default): `GET /procfs/NAME` reads, `PUT` or `POST
//!   /procfs/NAME` writes its body, and `GET /metrics` reads the `prometheus` tapset's file in
//!   Prometheus's text exposition format. [`tiny_http`] serves it.
//!
//! Each access becomes a [`Request`] on a channel; the session that runs the script's probes
//! answers it between its other work, so a probe body never runs on these threads.

use std::ffi::CString;
use std::io::Read as _;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The file the `prometheus` tapset's probe reads (`probe prometheus =
/// procfs("__prometheus").read`), which `GET /metrics` serves.
pub const PROMETHEUS_FILE: &str = "__prometheus";

/// The content type of Prometheus's text exposition format (version 0.0.4).
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// How often the FIFOs are looked at.
const POLL: Duration = Duration::from_millis(50);

/// How long a writer may take to finish writing, or a probe to answer, before the access
/// fails.
const PATIENCE: Duration = Duration::from_secs(30);

/// Where the host serves a script's procfs files (the command line's choice).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostFiles {
    /// The directory of the FIFOs; `None`: `$XDG_RUNTIME_DIR/exotap/PID` (or the temporary
    /// directory's `exotap-UID/PID`).
    pub dir: Option<PathBuf>,
    /// Where HTTP is served; `None`: no HTTP.
    pub http: Option<SocketAddr>,
}

/// One procfs file of a script.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSpec {
    /// Its name (one path component).
    pub name: String,
    /// A `.read` probe reads it.
    pub readable: bool,
    /// A `.write` probe takes writes to it.
    pub writable: bool,
    /// Permission bits of its FIFO.
    pub mode: u32,
}

/// What an access wants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Run the `.read` probes; the answer is the file's contents.
    Read,
    /// Run the `.write` probes with these bytes.
    Write(String),
}

/// One access to a file, to be answered with [`Request::answer`].
#[derive(Debug)]
pub struct Request {
    /// The file.
    pub name: String,
    /// What the access wants.
    pub op: Op,
    reply: mpsc::Sender<Result<String, String>>,
}

impl Request {
    /// Answers the access: the file's contents (empty for a write), or why it failed.
    pub fn answer(self, answer: Result<String, String>) {
        // The client may have gone (a timeout): nothing to tell it then.
        let _ = self.reply.send(answer);
    }
}

/// The running server: its threads, its directory, and the requests they make.
pub struct Server {
    requests: mpsc::Receiver<Request>,
    dir: Option<PathBuf>,
    /// Whether the directory was made here (and is removed at the end).
    made_dir: bool,
    files: Vec<FileSpec>,
    http: Option<SocketAddr>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    http_server: Option<Arc<tiny_http::Server>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("dir", &self.dir)
            .field("http", &self.http)
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

/// The default directory of the FIFOs: `$XDG_RUNTIME_DIR/exotap/PID`, or
/// `TMPDIR/exotap-UID/PID` where the runtime directory is not set.
pub fn default_dir() -> PathBuf {
    let pid = std::process::id().to_string();
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        Some(run) => PathBuf::from(run).join("exotap").join(pid),
        None => {
            // SAFETY: getuid has no preconditions and cannot fail.
            let uid = unsafe { libc::getuid() };
            std::env::temp_dir().join(format!("exotap-{uid}")).join(pid)
        }
    }
}

impl Server {
    /// Makes the FIFOs of `files` in the directory `host` names (made if missing; a FIFO
    /// whose name is taken by anything else is an error) and starts serving them, and HTTP
    /// when `host` asks for it.
    ///
    /// # Errors
    /// The directory or a FIFO cannot be made, or the HTTP address cannot be bound.
    pub fn start(files: Vec<FileSpec>, host: &HostFiles) -> anyhow::Result<Server> {
        use anyhow::Context as _;
        let dir = host.dir.clone().unwrap_or_else(default_dir);
        let made_dir = !dir.exists();
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot make the procfs directory {}", dir.display()))?;
        for f in &files {
            let path = dir.join(&f.name);
            if let Ok(meta) = std::fs::symlink_metadata(&path) {
                use std::os::unix::fs::FileTypeExt as _;
                if !meta.file_type().is_fifo() {
                    anyhow::bail!(
                        "{} exists and is not a FIFO: exotap will not replace it",
                        path.display()
                    );
                }
                std::fs::remove_file(&path)
                    .with_context(|| format!("cannot replace the old FIFO {}", path.display()))?;
            }
            let c = CString::new(path.as_os_str().as_encoded_bytes())
                .context("a procfs file name holds a NUL byte")?;
            // SAFETY: `c` is a NUL-terminated path.
            if unsafe { libc::mkfifo(c.as_ptr(), f.mode) } != 0 {
                return Err(std::io::Error::last_os_error())
                    .with_context(|| format!("cannot make the FIFO {}", path.display()));
            }
            // mkfifo applies the process's umask; the file's own mode is what was asked.
            use std::os::unix::fs::PermissionsExt as _;
            let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(f.mode));
        }
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        let mut http_server = None;
        let mut http = None;
        if let Some(addr) = host.http {
            let server = tiny_http::Server::http(addr)
                .map_err(|e| anyhow::anyhow!("cannot serve HTTP on {addr}: {e}"))?;
            http = server.server_addr().to_ip();
            let server = Arc::new(server);
            http_server = Some(Arc::clone(&server));
            let (tx, files, stop) = (tx.clone(), files.clone(), Arc::clone(&stop));
            threads.push(std::thread::spawn(move || {
                serve_http(&server, &files, &tx, &stop)
            }));
        }
        {
            let (dir, files, stop) = (dir.clone(), files.clone(), Arc::clone(&stop));
            threads.push(std::thread::spawn(move || {
                poll_fifos(&dir, &files, &tx, &stop)
            }));
        }
        Ok(Server {
            requests: rx,
            dir: Some(dir),
            made_dir,
            files,
            http,
            stop,
            threads,
            http_server,
        })
    }

    /// The directory of the FIFOs.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The address HTTP is served on (its port chosen when the user gave port 0).
    pub fn http(&self) -> Option<SocketAddr> {
        self.http
    }

    /// The next access, waiting at most `wait` for one.
    pub fn next(&self, wait: Duration) -> Option<Request> {
        if wait.is_zero() {
            self.requests.try_recv().ok()
        } else {
            self.requests.recv_timeout(wait).ok()
        }
    }

    /// One line for the user: where the files are.
    pub fn describe(&self) -> String {
        let names: Vec<&str> = self.files.iter().map(|f| f.name.as_str()).collect();
        let mut s = match &self.dir {
            Some(d) => format!("procfs files {} in {}", names.join(", "), d.display()),
            None => format!("procfs files {}", names.join(", ")),
        };
        if let Some(a) = self.http {
            s.push_str(&format!("; HTTP on http://{a}/procfs/NAME"));
            if self.files.iter().any(|f| f.name == PROMETHEUS_FILE) {
                s.push_str(&format!(" and http://{a}/metrics"));
            }
        }
        s
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(s) = &self.http_server {
            s.unblock();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        if let Some(dir) = &self.dir {
            for f in &self.files {
                let _ = std::fs::remove_file(dir.join(&f.name));
            }
            if self.made_dir {
                let _ = std::fs::remove_dir(dir);
            }
        }
    }
}

/// Sends `op` on `name` and waits for the answer.
fn ask(tx: &mpsc::Sender<Request>, name: &str, op: Op) -> Result<String, String> {
    let (reply, answer) = mpsc::channel();
    tx.send(Request {
        name: name.to_owned(),
        op,
        reply,
    })
    .map_err(|_| "the script has ended".to_owned())?;
    answer
        .recv_timeout(PATIENCE)
        .map_err(|_| "the script did not answer".to_owned())?
}

/// Opens `path` with `flags`; `None` with the errno when it fails.
fn open(path: &Path, flags: libc::c_int) -> Result<OwnedFd, std::io::Error> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: `c` is a NUL-terminated path; the fd returned is owned by the OwnedFd.
    let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        // SAFETY: `fd` was just opened and nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

/// Makes `fd` blocking again.
fn set_blocking(fd: &OwnedFd) {
    // SAFETY: fcntl on an fd we own.
    unsafe {
        let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK);
        }
    }
}

/// The FIFO poller: serves each waiting reader and writer in turn, until `stop`.
fn poll_fifos(dir: &Path, files: &[FileSpec], tx: &mpsc::Sender<Request>, stop: &AtomicBool) {
    // A reader that leaves before its answer is written raises SIGPIPE, which must not end
    // exotap (it may have the guest's text patched): blocked on this thread, the write
    // fails with EPIPE instead.
    // SAFETY: a signal set on the stack, for this thread's mask only.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGPIPE);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
    while !stop.load(Ordering::SeqCst) {
        for f in files {
            let path = dir.join(&f.name);
            if f.readable {
                serve_reader(&path, &f.name, tx);
            }
            if f.writable {
                serve_writer(&path, &f.name, tx);
            }
        }
        std::thread::sleep(POLL);
    }
}

/// Answers a reader waiting on the FIFO at `path`, if there is one.
fn serve_reader(path: &Path, name: &str, tx: &mpsc::Sender<Request>) {
    // Succeeds only while a reader has the FIFO open (ENXIO otherwise).
    let Ok(fd) = open(path, libc::O_WRONLY | libc::O_NONBLOCK) else {
        return;
    };
    set_blocking(&fd);
    let answer = ask(tx, name, Op::Read).unwrap_or_else(|why| {
        tracing::warn!("procfs file {name}: {why}");
        String::new()
    });
    let mut file = std::fs::File::from(fd);
    // A reader that left (EPIPE) is not an error of the script.
    if std::io::Write::write_all(&mut file, answer.as_bytes()).is_err() {
        return;
    }
    // Closed only once the reader has taken it all: bytes left in the pipe would be taken
    // for a writer's by the next look for writers.
    let began = Instant::now();
    while unread(&file) > 0 && began.elapsed() < PATIENCE {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The bytes written into the pipe of `file` and not read yet.
fn unread(file: &std::fs::File) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int through the pointer, on an fd we own.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), libc::FIONREAD, &mut n) };
    if r < 0 {
        0
    } else {
        usize::try_from(n).unwrap_or(0)
    }
}

/// Takes what a writer waiting on the FIFO at `path` writes, if there is one, and hands it to
/// the `.write` probes once the writer closes.
fn serve_writer(path: &Path, name: &str, tx: &mpsc::Sender<Request>) {
    let Ok(fd) = open(path, libc::O_RDONLY | libc::O_NONBLOCK) else {
        return;
    };
    let mut file = std::fs::File::from(fd);
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    let began = Instant::now();
    loop {
        match file.read(&mut buf) {
            // End of file: no writer (nothing read yet), or the writer closed.
            Ok(0) => break,
            Ok(n) => data.extend_from_slice(&buf[..n]),
            // A writer is connected and has not written (more) yet.
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if began.elapsed() > PATIENCE {
                    tracing::warn!("procfs file {name}: a writer kept it open for 30 s; ignored");
                    return;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                tracing::warn!("procfs file {name}: {e}");
                return;
            }
        }
    }
    if data.is_empty() {
        return;
    }
    let text = String::from_utf8_lossy(&data).into_owned();
    if let Err(why) = ask(tx, name, Op::Write(text)) {
        tracing::warn!("procfs file {name}: {why}");
    }
}

/// The HTTP server's loop: each request becomes a [`Request`], answered in its response.
fn serve_http(
    server: &tiny_http::Server,
    files: &[FileSpec],
    tx: &mpsc::Sender<Request>,
    stop: &AtomicBool,
) {
    while !stop.load(Ordering::SeqCst) {
        let Ok(mut request) = server.recv() else {
            break;
        };
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let (status, content_type, body) = http_answer(&mut request, files, tx);
        let mut response = tiny_http::Response::from_string(body).with_status_code(status);
        // Both halves are ASCII constants: the header is always valid.
        if let Ok(header) =
            tiny_http::Header::from_bytes(&b"Content-Type"[..], content_type.as_bytes())
        {
            response = response.with_header(header);
        }
        let _ = request.respond(response);
    }
}

/// (status, content type, body) for one HTTP request.
fn http_answer(
    request: &mut tiny_http::Request,
    files: &[FileSpec],
    tx: &mpsc::Sender<Request>,
) -> (u16, String, String) {
    use tiny_http::Method;
    let plain = "text/plain; charset=utf-8".to_owned();
    let url = request
        .url()
        .split('?')
        .next()
        .unwrap_or_default()
        .to_owned();
    let method = request.method().clone();
    let (name, metrics) = if url == "/metrics" {
        (PROMETHEUS_FILE.to_owned(), true)
    } else if let Some(name) = url.strip_prefix("/procfs/") {
        (name.to_owned(), false)
    } else if url == "/" || url == "/procfs" || url == "/procfs/" {
        let list: Vec<String> = files
            .iter()
            .map(|f| {
                let how = match (f.readable, f.writable) {
                    (true, true) => "read, write",
                    (true, false) => "read",
                    _ => "write",
                };
                format!("/procfs/{} ({how})\n", f.name)
            })
            .collect();
        return (200, plain, list.concat());
    } else {
        return (
            404,
            plain,
            format!("no such path {url}: try /procfs/NAME or /metrics\n"),
        );
    };
    let Some(file) = files.iter().find(|f| f.name == name) else {
        let why = if metrics {
            "the script has no `probe prometheus` (the prometheus tapset's file)\n".to_owned()
        } else {
            format!("the script has no procfs file {name:?}\n")
        };
        return (404, plain, why);
    };
    match method {
        Method::Get | Method::Head if file.readable => match ask(tx, &name, Op::Read) {
            Ok(body) => {
                let ty = if metrics {
                    PROMETHEUS_CONTENT_TYPE.to_owned()
                } else {
                    plain
                };
                (200, ty, body)
            }
            Err(why) => (503, plain, format!("{why}\n")),
        },
        Method::Put | Method::Post if file.writable && !metrics => {
            let mut body = String::new();
            if request.as_reader().read_to_string(&mut body).is_err() {
                return (400, plain, "the body is not UTF-8 text\n".to_owned());
            }
            match ask(tx, &name, Op::Write(body)) {
                Ok(_) => (204, plain, String::new()),
                Err(why) => (503, plain, format!("{why}\n")),
            }
        }
        _ => (
            405,
            plain,
            format!(
                "{method} is not allowed on {name}: it has {} probe\n",
                match (file.readable, file.writable) {
                    (true, true) => "a .read and a .write",
                    (true, false) => "only a .read",
                    _ => "only a .write",
                }
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    fn spec(name: &str, readable: bool, writable: bool) -> FileSpec {
        FileSpec {
            name: name.into(),
            readable,
            writable,
            mode: 0o600,
        }
    }

    /// Answers every request of `server` on a thread: reads with "N:<last written>", N
    /// counting reads; writes are kept. Returns what it saw when `server` is dropped.
    fn echo(server: Arc<std::sync::Mutex<Option<Server>>>) -> JoinHandle<Vec<(String, Op)>> {
        std::thread::spawn(move || {
            let mut seen = Vec::new();
            let mut last = String::new();
            let mut reads = 0;
            loop {
                let request = {
                    let guard = server.lock().unwrap();
                    let Some(s) = guard.as_ref() else { break };
                    s.next(Duration::from_millis(10))
                };
                let Some(r) = request else { continue };
                seen.push((r.name.clone(), r.op.clone()));
                match &r.op {
                    Op::Read => {
                        reads += 1;
                        let answer = format!("{reads}:{last}");
                        r.answer(Ok(answer));
                    }
                    Op::Write(w) => {
                        last = w.clone();
                        r.answer(Ok(String::new()));
                    }
                }
            }
            seen
        })
    }

    fn http(addr: SocketAddr, request: &str) -> String {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn a_value_round_trips_through_the_fifo_and_over_http() {
        let dir = tempfile::tempdir().unwrap();
        let host = HostFiles {
            dir: Some(dir.path().join("files")),
            http: Some("127.0.0.1:0".parse().unwrap()),
        };
        let server =
            Server::start(vec![spec("x", true, true), spec("ro", true, false)], &host).unwrap();
        let addr = server.http().unwrap();
        let fifo = dir.path().join("files/x");
        let shared = Arc::new(std::sync::Mutex::new(Some(server)));
        let answering = echo(Arc::clone(&shared));

        // Write through the FIFO, read back through it: the reads run in order.
        std::fs::write(&fifo, "hello").unwrap();
        let first = std::fs::read_to_string(&fifo).unwrap();
        assert_eq!(first, "1:hello");
        // Over HTTP: a PUT writes, a GET reads.
        let put = http(
            addr,
            "PUT /procfs/x HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nConnection: close\r\n\r\nworld",
        );
        assert!(put.starts_with("HTTP/1.1 204"), "{put}");
        let get = http(
            addr,
            "GET /procfs/x HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        );
        assert!(get.starts_with("HTTP/1.1 200"), "{get}");
        assert!(get.ends_with("\r\n\r\n2:world"), "{get}");
        // A file with only a .read refuses a write; an unknown file is 404; no metrics
        // without the prometheus file.
        let refused = http(
            addr,
            "POST /procfs/ro HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\nConnection: close\r\n\r\nz",
        );
        assert!(refused.starts_with("HTTP/1.1 405"), "{refused}");
        let missing = http(
            addr,
            "GET /procfs/nope HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        );
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        let metrics = http(
            addr,
            "GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        );
        assert!(metrics.starts_with("HTTP/1.1 404"), "{metrics}");

        let server = shared.lock().unwrap().take();
        drop(server);
        let seen = answering.join().unwrap();
        assert_eq!(
            seen,
            vec![
                ("x".to_owned(), Op::Write("hello".into())),
                ("x".to_owned(), Op::Read),
                ("x".to_owned(), Op::Write("world".into())),
                ("x".to_owned(), Op::Read),
            ]
        );
        // The FIFOs and the directory exotap made are gone with the server.
        assert!(!fifo.exists());
        assert!(!dir.path().join("files").exists());
    }

    #[test]
    fn metrics_carry_prometheus_content_type() {
        let dir = tempfile::tempdir().unwrap();
        let host = HostFiles {
            dir: Some(dir.path().to_owned()),
            http: Some("127.0.0.1:0".parse().unwrap()),
        };
        let server = Server::start(vec![spec(PROMETHEUS_FILE, true, false)], &host).unwrap();
        let addr = server.http().unwrap();
        let shared = Arc::new(std::sync::Mutex::new(Some(server)));
        let answering = echo(Arc::clone(&shared));
        let got = http(
            addr,
            "GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        );
        assert!(got.starts_with("HTTP/1.1 200"), "{got}");
        assert!(
            got.to_ascii_lowercase()
                .contains(&format!("content-type: {PROMETHEUS_CONTENT_TYPE}")),
            "{got}"
        );
        drop(shared.lock().unwrap().take());
        answering.join().unwrap();
        // A directory that existed before is left in place.
        assert!(dir.path().exists());
        assert!(!dir.path().join(PROMETHEUS_FILE).exists());
    }

    #[test]
    fn a_name_taken_by_a_regular_file_is_refused_not_replaced() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("x"), "keep me").unwrap();
        let host = HostFiles {
            dir: Some(dir.path().to_owned()),
            http: None,
        };
        let err = Server::start(vec![spec("x", true, false)], &host).unwrap_err();
        assert!(err.to_string().contains("is not a FIFO"), "{err}");
        assert_eq!(
            std::fs::read_to_string(dir.path().join("x")).unwrap(),
            "keep me"
        );
    }
}
