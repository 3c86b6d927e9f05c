//! A thread that takes records out of the trace rings through the shared guest RAM while the
//! guest runs, apart from the thread that decodes and prints them (issue 19's zero-stop data
//! path).
//!
//! Why a thread of its own: a ring holds about a tenth of a second of the fastest traced
//! loop under TCG. When the same thread both drains and formats (a million lines a second,
//! written to a file or a pipe), a slow write or a busy host delays the next drain past
//! that, and records are overwritten. The drainer only copies raw records out (the
//! concurrent reader of [`crate::rings`]) and hands them over a channel; it polls again at
//! once while there is more, and otherwise after a sleep from [`POLL`] to [`MAX_POLL`] that
//! follows the rate it sees (a pass costs about the same however few records it takes, so
//! fewer, fuller passes cost less, and no ring gets past a quarter full at that rate). What it took waits in host
//! memory until the printing side catches up: nothing is lost to a slow consumer.
//!
//! Buffers: records go out in buffers of [`CHUNK`] records that come back to the drainer when
//! the consumer drops their [`Batch`], and the drainer keeps [`READY_BYTES`] of them written
//! once (faulted in) while the rings are empty. Measured (`perf record -e minor-faults` on a
//! `trace` of 400,000 records, issue 19): with a fresh `Vec` per batch every batch was new
//! memory while the printing side lagged a burst, about 5,000 page faults inside the passes
//! that took records; those faults now happen before a burst, while nothing is there to take.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::rings::{drain_concurrent_into, RingMemory, RingSet, Taken};

/// The shortest sleep after a pass that found little to take.
pub const POLL: Duration = Duration::from_millis(1);

/// The longest sleep between passes: a ring fills in about a tenth of a second at the
/// fastest traced loop, so a writer that starts at full speed during a sleep fills a tenth
/// of it at most.
pub const MAX_POLL: Duration = Duration::from_millis(10);

/// A pass that took fewer records than this sleeps [`POLL`] before the next.
const BUSY: usize = 4096;

/// Records in one buffer the drainer hands over (the reader's own batch, [`crate::rings`]).
pub const CHUNK: u64 = 4096;

/// Bytes of buffers the drainer keeps written once and ready while the rings are empty:
/// about a fifth of a second of the fastest traced loop under TCG (1.3 M records/s of 64
/// bytes), the lag of a printing side that falls behind during a burst.
pub const READY_BYTES: usize = 16 << 20;

/// The smallest page size: [`Pool::fill`] writes a byte this far apart.
const PAGE: usize = 4096;

/// Up to [`CHUNK`] of one vCPU's records, `record` bytes each, oldest first. Dropping it hands
/// its buffer back to the drainer.
#[derive(Debug)]
pub struct Batch {
    /// The vCPU (its ring).
    pub cpu: u32,
    /// The records one after the other.
    pub records: Vec<u8>,
    /// Where the buffer goes back to.
    back: Option<Sender<Vec<u8>>>,
}

impl Drop for Batch {
    fn drop(&mut self) {
        if let Some(back) = self.back.take() {
            let mut records = std::mem::take(&mut self.records);
            records.clear();
            // A drainer that has stopped no longer takes it: freed here.
            let _ = back.send(records);
        }
    }
}

/// The drainer's buffers: those ready (written once, so their pages are there), and those
/// coming back from dropped batches.
struct Pool {
    ready: Vec<Vec<u8>>,
    back: Receiver<Vec<u8>>,
    sender: Sender<Vec<u8>>,
    /// Bytes of one buffer.
    bytes: usize,
    /// Buffers kept ready.
    keep: usize,
    /// Buffers handed over in batches and not back yet.
    out: usize,
    /// Buffers written once while the rings were empty.
    prepared: u64,
    /// Buffers made when one was needed and none was ready.
    made: u64,
}

impl Pool {
    fn new(record: usize) -> Self {
        let bytes = usize::try_from(CHUNK)
            .unwrap_or(4096)
            .saturating_mul(record);
        let (sender, back) = channel();
        Self {
            ready: Vec::new(),
            back,
            sender,
            bytes,
            keep: (READY_BYTES / bytes.max(1)).max(2),
            out: 0,
            prepared: 0,
            made: 0,
        }
    }

    /// Takes in the buffers that came back (up to the number kept).
    fn collect(&mut self) {
        while let Ok(buffer) = self.back.try_recv() {
            self.out = self.out.saturating_sub(1);
            if self.ready.len() < self.keep && buffer.capacity() >= self.bytes {
                self.ready.push(buffer);
            }
        }
    }

    /// A buffer for the next batch: a ready one, else one made now (new memory: its pages
    /// come in as the records are copied; counted in [`Pool::made`]).
    fn take(&mut self) -> Vec<u8> {
        self.collect();
        self.ready.pop().unwrap_or_else(|| {
            self.made += 1;
            Vec::with_capacity(self.bytes)
        })
    }

    /// Puts back a buffer that was not handed over.
    fn give_back(&mut self, mut buffer: Vec<u8>) {
        buffer.clear();
        if self.ready.len() < self.keep {
            self.ready.push(buffer);
        }
    }

    /// Makes buffers until [`Pool::keep`] are ready or on their way back, each written once
    /// (a consumer that holds buffers gets no more made for it).
    fn fill(&mut self) {
        self.collect();
        while self.ready.len() + self.out < self.keep {
            let mut buffer: Vec<u8> = Vec::with_capacity(self.bytes);
            // A byte in every page brings the page in (`vec![0; n]` would not: calloc leaves
            // fresh pages of a large allocation untouched).
            for byte in buffer.spare_capacity_mut().iter_mut().step_by(PAGE) {
                byte.write(0);
            }
            self.ready.push(std::hint::black_box(buffer));
            self.prepared += 1;
        }
    }
}

/// What the drainer leaves when it stops: where each ring's reader is, and what it counted.
#[derive(Debug, Clone, Default)]
pub struct DrainState {
    /// Per vCPU: records taken from its ring so far.
    pub taken: Vec<u64>,
    /// Per vCPU: records lost (overwritten before they were read, or reused during a read).
    pub lost: Vec<u64>,
    /// Records taken by the drainer.
    pub records: u64,
    /// Time spent reading the rings (all passes, also those that found nothing), wall clock:
    /// on a busy host it includes the time the thread waited for a CPU.
    pub reading: Duration,
    /// The same passes' CPU time (the thread's own clock): what reading cost, load aside.
    pub reading_cpu: Duration,
    /// Passes over the rings.
    pub passes: u64,
    /// The passes that took at least one record: the drain rate while there was something to
    /// take is [`DrainState::records`] over their time (the other passes found the rings
    /// empty, a cost that grows with the run's idle time, not with its records).
    pub busy_passes: u64,
    /// Wall-clock time of [`DrainState::busy_passes`].
    pub busy_reading: Duration,
    /// CPU time of [`DrainState::busy_passes`] (the thread's clock read at each end of every
    /// pass).
    pub busy_reading_cpu: Duration,
    /// Buffers written once while the rings were empty, ready for the batches to come.
    pub prepared_buffers: u64,
    /// Buffers made during passes that took records, none being ready (their pages came in
    /// as the records were copied).
    pub new_buffers: u64,
    /// Why the drainer stopped early, if a read failed.
    pub error: Option<String>,
}

/// The running drainer: batches arrive on [`Drainer::try_batches`]; [`Drainer::stop`] ends
/// it and gives back the readers' positions.
#[derive(Debug)]
pub struct Drainer {
    stop: Arc<AtomicBool>,
    batches: Receiver<Batch>,
    thread: Option<JoinHandle<DrainState>>,
}

impl Drainer {
    /// Starts draining the rings `set` of `mem`, each ring's reader at `state.taken`.
    ///
    /// # Errors
    /// When the thread cannot be started.
    pub fn start<M>(mem: M, set: RingSet, mut state: DrainState) -> std::io::Result<Self>
    where
        M: RingMemory + Send + 'static,
        M::Error: std::fmt::Display,
    {
        let cpus = set.cpus as usize;
        state.taken.resize(cpus, 0);
        state.lost.resize(cpus, 0);
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, batches) = channel();
        let stopping = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("exotap-drainer".into())
            .spawn(move || {
                let record = usize::try_from(set.record.max(1)).unwrap_or(1);
                // The thread only reads and sleeps: its CPU time is what reading cost (one
                // clock read at each end, not two system calls a pass).
                let cpu_started = thread_cpu_time();
                let mut sleep = POLL;
                let mut last_pass: Option<Instant> = None;
                let mut pool = Pool::new(record);
                pool.fill();
                // What the thread leaves when it returns.
                let finish = |mut state: DrainState, pool: &Pool| {
                    state.reading_cpu = thread_cpu_time().saturating_sub(cpu_started);
                    state.prepared_buffers = pool.prepared;
                    state.new_buffers = pool.made;
                    state
                };
                loop {
                    // Read the flag before the pass: the pass after a stop request still
                    // runs, so what was in the rings at the request is taken.
                    let stopping = stopping.load(Ordering::Acquire);
                    let started = Instant::now();
                    let pass_cpu = thread_cpu_time();
                    let since_last = last_pass.map_or(POLL, |l| started.duration_since(l));
                    last_pass = Some(started);
                    let mut took = 0;
                    let mut most = 0;
                    for cpu in 0..set.cpus {
                        match drain_ring(&mem, &set, cpu, &mut state, &mut pool, &tx) {
                            Ok(Some(n)) => {
                                took += n;
                                most = most.max(n);
                            }
                            // Nobody listens any more: stop.
                            Ok(None) => return finish(state, &pool),
                            Err(e) => {
                                state.error = Some(format!("ring of vCPU {cpu}: {e}"));
                                return finish(state, &pool);
                            }
                        }
                    }
                    let pass = started.elapsed();
                    state.reading += pass;
                    state.records += took as u64;
                    state.passes += 1;
                    if took > 0 {
                        state.busy_passes += 1;
                        state.busy_reading += pass;
                        state.busy_reading_cpu += thread_cpu_time().saturating_sub(pass_cpu);
                    }
                    if stopping {
                        return finish(state, &pool);
                    }
                    if took == 0 {
                        // Nothing to take: the time to make buffers ready for a burst.
                        pool.fill();
                    }
                    if took < BUSY {
                        sleep = next_sleep(sleep, most, since_last, set.slots);
                        std::thread::sleep(sleep);
                    } else {
                        sleep = POLL;
                    }
                }
            })?;
        Ok(Self {
            stop,
            batches,
            thread: Some(thread),
        })
    }

    /// The batches taken since the last call, without waiting.
    pub fn try_batches(&self) -> Vec<Batch> {
        let mut out = Vec::new();
        loop {
            match self.batches.try_recv() {
                Ok(batch) => out.push(batch),
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => return out,
            }
        }
    }

    /// Whether the thread has ended on its own (a failed read).
    pub fn ended(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Stops the thread after one more pass; the batches it had not handed over yet, and
    /// its state (the readers' positions for whoever reads the rings next).
    pub fn stop(mut self) -> (Vec<Batch>, DrainState) {
        self.stop.store(true, Ordering::Release);
        let state = self
            .thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_else(|| DrainState {
                error: Some("the drainer thread panicked".into()),
                ..DrainState::default()
            });
        (self.try_batches(), state)
    }
}

/// One pass over vCPU `cpu`'s ring: its records, in buffers from `pool`, sent on `tx`; how
/// many it took, or `None` when nobody receives batches any more. At most a ring's worth (a
/// hostile head far ahead costs one ring a pass, no more).
fn drain_ring<M: RingMemory>(
    mem: &M,
    set: &RingSet,
    cpu: u32,
    state: &mut DrainState,
    pool: &mut Pool,
    tx: &Sender<Batch>,
) -> Result<Option<usize>, M::Error> {
    let i = cpu as usize;
    let record = usize::try_from(set.record.max(1)).unwrap_or(1);
    let mut budget = u64::from(set.slots.max(1));
    let mut took = 0;
    let (Some(taken), Some(lost)) = (state.taken.get_mut(i), state.lost.get_mut(i)) else {
        return Ok(Some(0));
    };
    while budget > 0 {
        let mut out = Taken {
            records: pool.take(),
            lost: 0,
        };
        let before = *taken;
        let more = drain_concurrent_into(mem, set, cpu, taken, false, CHUNK.min(budget), &mut out);
        budget = budget.saturating_sub(taken.saturating_sub(before).max(1));
        *lost = lost.saturating_add(out.lost);
        let more = more?;
        let n = out.records.len() / record;
        took += n;
        if n == 0 {
            pool.give_back(out.records);
        } else {
            let batch = Batch {
                cpu,
                records: out.records,
                back: Some(pool.sender.clone()),
            };
            if tx.send(batch).is_err() {
                return Ok(None);
            }
            pool.out += 1;
        }
        if !more {
            break;
        }
    }
    Ok(Some(took))
}

/// The sleep before the next pass, after one that took `most` records from its fullest ring
/// `since_last` after the pass before: long enough that passes take records in bulk (the
/// cost of a pass is mostly fixed), short enough that no ring fills past a quarter at the
/// rate just seen; from [`POLL`] to [`MAX_POLL`], doubling while the rings stay empty.
fn next_sleep(previous: Duration, most: usize, since_last: Duration, slots: u32) -> Duration {
    let quarter = u128::from(slots / 4).max(1);
    let sleep = match u128::try_from(most) {
        Ok(0) | Err(_) => previous.saturating_mul(2),
        // At `most` records per `since_last`, a quarter ring takes this long.
        Ok(most) => {
            let nanos = since_last.as_nanos().saturating_mul(quarter) / most;
            Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
        }
    };
    sleep.clamp(POLL, MAX_POLL)
}

/// The calling thread's CPU time so far (zero if the clock cannot be read).
fn thread_cpu_time() -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable timespec; the call only writes it.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        u64::try_from(now.tv_sec).unwrap_or(0),
        u32::try_from(now.tv_nsec).unwrap_or(0),
    )
}

impl Drop for Drainer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Guest memory as a shared byte array at address 0 (a writer thread and the drainer).
    #[derive(Clone)]
    struct Ram(Arc<Mutex<Vec<u8>>>);

    impl Ram {
        fn word(&self, addr: u64) -> u64 {
            let b = self.0.lock().unwrap();
            let a = addr as usize;
            u64::from_le_bytes(b[a..a + 8].try_into().unwrap())
        }

        fn put(&self, addr: u64, value: u64) {
            let a = addr as usize;
            self.0.lock().unwrap()[a..a + 8].copy_from_slice(&value.to_le_bytes());
        }
    }

    impl RingMemory for Ram {
        type Error = String;

        fn load_acquire(&self, addr: u64) -> Result<u64, String> {
            if addr as usize + 8 > self.0.lock().unwrap().len() {
                return Err(format!("{addr:#x} outside"));
            }
            Ok(self.word(addr))
        }

        fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), String> {
            let b = self.0.lock().unwrap();
            let src = b
                .get(addr as usize..addr as usize + buf.len())
                .ok_or_else(|| format!("{addr:#x} outside"))?;
            buf.copy_from_slice(src);
            Ok(())
        }
    }

    const SET: RingSet = RingSet {
        base: 0,
        cpus: 2,
        slots: 64,
        record: 16,
    };

    /// The patch code's steps for record `index` of `cpu`: reserve, lap tag, value, the
    /// finished mark last.
    fn write_record(ram: &Ram, cpu: u32, index: u64, value: u64) {
        ram.put(SET.ring(cpu), index + 1);
        let at = SET.slot(cpu, index % u64::from(SET.slots));
        let tag = crate::rings::lap_tag(index, SET.slots);
        ram.put(at, tag);
        ram.put(at + 8, value);
        ram.put(at, 1000 + 2 * index + tag);
    }

    fn values(batches: &[Batch], cpu: u32) -> Vec<u64> {
        batches
            .iter()
            .filter(|b| b.cpu == cpu)
            .flat_map(|b| b.records.chunks_exact(16))
            .map(|r| u64::from_le_bytes(r[8..16].try_into().unwrap()))
            .collect()
    }

    #[test]
    fn the_drainer_streams_every_record_a_slower_writer_writes_in_order() {
        let ram = Ram(Arc::new(Mutex::new(vec![0; SET.bytes() as usize])));
        let drainer = Drainer::start(ram.clone(), SET, DrainState::default()).unwrap();
        let mut batches = Vec::new();

        // Three rings' worth per vCPU, in bursts smaller than a ring, the drainer keeping up.
        for burst in 0..12u64 {
            for i in 0..16 {
                let index = burst * 16 + i;
                write_record(&ram, 0, index, index);
                write_record(&ram, 1, index, 10_000 + index);
            }
            let written = (burst as usize + 1) * 16;
            while values(&batches, 0).len() < written || values(&batches, 1).len() < written {
                batches.extend(drainer.try_batches());
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let (rest, state) = drainer.stop();
        batches.extend(rest);

        assert_eq!(values(&batches, 0), (0..192).collect::<Vec<_>>());
        assert_eq!(values(&batches, 1), (10_000..10_192).collect::<Vec<_>>());
        assert_eq!(
            (state.taken, state.lost, state.records, state.error),
            (vec![192, 192], vec![0, 0], 384, None)
        );
        // 12 bursts, each taken in one pass or more; the passes that found nothing (the
        // drainer polls while the writer sleeps) are not among them.
        assert!(
            (12..state.passes).contains(&state.busy_passes),
            "{} busy of {} passes",
            state.busy_passes,
            state.passes
        );
        assert!(state.busy_reading <= state.reading);
    }

    #[test]
    fn records_go_out_in_buffers_made_ready_before_the_burst_and_the_buffers_come_back() {
        const BIG: RingSet = RingSet {
            base: 0,
            cpus: 1,
            slots: 16_384,
            record: 16,
        };
        let ram = Ram(Arc::new(Mutex::new(vec![0; BIG.bytes() as usize])));
        let write = |index: u64| {
            ram.put(BIG.ring(0), index + 1);
            let at = BIG.slot(0, index % u64::from(BIG.slots));
            let tag = crate::rings::lap_tag(index, BIG.slots);
            ram.put(at + 8, index);
            ram.put(at, 1000 + 2 * index + tag);
        };
        // A burst of 2.5 buffers' worth before the first pass.
        for index in 0..10_000 {
            write(index);
        }
        let drainer = Drainer::start(ram.clone(), BIG, DrainState::default()).unwrap();
        let mut got: Vec<u64> = Vec::new();
        let mut sizes = Vec::new();
        // Takes batches until `n` records came, dropping each (its buffer goes back).
        let mut take_until = |n: usize| {
            while got.len() < n {
                for batch in drainer.try_batches() {
                    sizes.push(batch.records.len() / 16);
                    got.extend(
                        batch
                            .records
                            .chunks_exact(16)
                            .map(|r| u64::from_le_bytes(r[8..16].try_into().unwrap())),
                    );
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        take_until(10_000);
        // A second burst, after the first's buffers came back.
        std::thread::sleep(Duration::from_millis(20));
        for index in 10_000..20_000 {
            write(index);
        }
        take_until(20_000);
        let (rest, state) = drainer.stop();

        assert!(rest.is_empty());
        assert_eq!(got, (0..20_000).collect::<Vec<_>>());
        assert!(
            sizes.iter().all(|&n| (1..=CHUNK as usize).contains(&n)),
            "{sizes:?}"
        );
        // The first pass: three buffers, the first two full.
        assert_eq!(sizes[..3], [4096, 4096, 1808]);
        let ready = READY_BYTES / (CHUNK as usize * 16);
        assert_eq!(
            (state.prepared_buffers, state.new_buffers, state.lost),
            (ready as u64, 0, vec![0])
        );
    }

    #[test]
    fn a_dropped_batch_gives_its_buffer_back_and_no_buffer_is_made_for_one_still_out() {
        let mut pool = Pool::new(16);
        pool.fill();
        assert_eq!(
            (pool.ready.len(), pool.prepared, pool.made),
            (pool.keep, 256, 0)
        );
        let first = pool.take();
        let at = first.as_ptr();
        let batch = Batch {
            cpu: 0,
            records: first,
            back: Some(pool.sender.clone()),
        };
        pool.out += 1;
        // While the batch is out, filling makes nothing (it will come back).
        pool.fill();
        assert_eq!((pool.ready.len(), pool.prepared), (pool.keep - 1, 256));
        drop(batch);
        pool.collect();
        assert_eq!((pool.ready.len(), pool.out), (pool.keep, 0));
        // The same memory, emptied, is the next buffer taken.
        let again = pool.take();
        assert_eq!((again.as_ptr(), again.len(), pool.made), (at, 0, 0));
        // None ready: one is made, and counted.
        while !pool.ready.is_empty() {
            pool.take();
        }
        assert!(pool.take().capacity() >= pool.bytes);
        assert_eq!(pool.made, 1);
    }

    #[test]
    fn the_sleep_grows_while_the_rings_are_empty_and_shrinks_to_keep_a_ring_a_quarter_full() {
        let ms = Duration::from_millis;
        // Empty rings: doubling, up to the longest sleep.
        assert_eq!(next_sleep(POLL, 0, ms(1), 1 << 16), ms(2));
        assert_eq!(next_sleep(ms(8), 0, ms(9), 1 << 16), MAX_POLL);
        // 1,000 records in 2 ms into a ring of 16,384: a quarter (4,096) takes 8.2 ms.
        assert_eq!(
            next_sleep(ms(2), 1000, ms(2), 1 << 14),
            Duration::from_nanos(8_192_000)
        );
        // A fast writer: a quarter ring in less than the shortest sleep.
        assert_eq!(next_sleep(ms(5), 400_000, ms(5), 1 << 16), POLL);
        // A slow one: never past the longest.
        assert_eq!(next_sleep(ms(1), 1, ms(1), 1 << 16), MAX_POLL);
    }

    #[test]
    fn a_ring_out_of_reach_stops_the_drainer_with_the_reason() {
        let ram = Ram(Arc::new(Mutex::new(vec![0; 64])));
        let drainer = Drainer::start(ram, SET, DrainState::default()).unwrap();
        while !drainer.ended() {
            std::thread::sleep(Duration::from_millis(1));
        }

        let (_, state) = drainer.stop();

        assert!(
            state
                .error
                .as_deref()
                .is_some_and(|e| e.contains("outside")),
            "{:?}",
            state.error
        );
    }
}
