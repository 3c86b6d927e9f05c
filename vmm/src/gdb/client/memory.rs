//! Memory reads and writes of a [`GdbClient`]: split into packets, pipelined in windows
//! (QEMU's gdbstub answers one packet at a time; a window of requests in one write saves the
//! round trips).

use super::{
    from_hex, ok_reply, packet, reply_text, short, to_hex, Deadline, GdbClient, GdbError,
    PIPELINE_WINDOW, READ_WINDOW,
};

impl GdbClient {
    fn chunk(&self) -> usize {
        // Hex doubles the size; leave room for the command and framing.
        (self.packet_size.saturating_sub(32) / 2).clamp(16, 4096)
    }

    /// Reads memory at `addr` (virtual or physical per [`Self::set_physical_mode`]).
    ///
    /// # Errors
    /// When the stub refuses (unmapped address) or fails.
    pub fn read_memory(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), GdbError> {
        let chunk = self.chunk();
        let mut done = 0usize;
        if buf.len() > chunk && (!self.ack_mode || self.pipelines_with_acks) {
            done = self.read_pipelined(addr, buf)?;
        }
        while done < buf.len() {
            let n = chunk.min(buf.len() - done);
            let at = addr.wrapping_add(done as u64);
            let request = format!("m{at:x},{n:x}");
            let reply = self.request(&request)?;
            let bytes = from_hex(reply.as_bytes())
                .filter(|b| !b.is_empty() && b.len() <= n)
                .ok_or_else(|| GdbError::Unexpected {
                    request: request.clone(),
                    reply: short(&reply),
                })?;
            buf[done..done + bytes.len()].copy_from_slice(&bytes);
            done += bytes.len();
        }
        Ok(())
    }

    /// The chunks of a read of more than one packet, [`READ_WINDOW`] requests at a time
    /// sent without waiting, then their answers in order (a round trip per window, not per
    /// chunk: a ring or a page table of 32 KiB is 16 chunks). Returns the bytes read from the
    /// start of `buf`: all of them, or up to a short answer, after which the caller goes on
    /// one chunk at a time.
    fn read_pipelined(&mut self, addr: u64, buf: &mut [u8]) -> Result<usize, GdbError> {
        let chunk = self.chunk();
        let mut done = 0usize;
        while done < buf.len() {
            let mut framed = Vec::new();
            let mut asked = Vec::new();
            let mut at = done;
            while at < buf.len() && asked.len() < READ_WINDOW {
                let n = chunk.min(buf.len() - at);
                let request = format!("m{:x},{n:x}", addr.wrapping_add(at as u64));
                framed.extend_from_slice(&packet::encode(request.as_bytes()));
                asked.push((at, n, request));
                self.packets += 1;
                at += n;
            }
            self.write_raw(&framed, b"pipelined m packets")?;
            self.last_sent.clear();
            let deadline = Deadline::after(self.timeout);
            self.pipelining = self.ack_mode;
            // Every answer is read, whatever happens, so the stream stays in step.
            let mut outcome: Result<bool, GdbError> = Ok(true);
            for (at, n, request) in &asked {
                let answer = self.answer(&deadline, request, false);
                let Ok(true) = outcome else {
                    if answer.is_err() {
                        // The stream holds no more answers we can trust.
                        break;
                    }
                    continue;
                };
                outcome = answer.and_then(|reply| {
                    let reply = reply_text(request, &reply)?;
                    let bytes = from_hex(reply.as_bytes())
                        .filter(|b| !b.is_empty() && b.len() <= *n)
                        .ok_or_else(|| GdbError::Unexpected {
                            request: request.clone(),
                            reply: short(&reply),
                        })?;
                    buf[*at..*at + bytes.len()].copy_from_slice(&bytes);
                    done = *at + bytes.len();
                    // A short answer ends the pipelined part.
                    Ok(bytes.len() == *n)
                });
            }
            let acked = self.end_window();
            let whole = outcome?;
            acked?;
            if !whole {
                return Ok(done);
            }
        }
        Ok(done)
    }

    /// Writes memory at `addr` (virtual or physical per [`Self::set_physical_mode`]), in
    /// packets of at most [`Self::packet_size`], pipelined as
    /// [`Self::write_memory_batch`] does.
    ///
    /// # Errors
    /// When the stub refuses or fails.
    pub fn write_memory(&mut self, addr: u64, data: &[u8]) -> Result<(), GdbError> {
        self.write_memory_batch(&[(addr, data)]).map_err(|(_, e)| e)
    }

    /// Writes each `(address, bytes)` in order, as `M` packets sent without waiting for
    /// each answer: up to `PIPELINE_WINDOW` bytes of requests go out in one write, then
    /// their answers are read in order. A round trip per packet is what a gdbstub write
    /// costs otherwise, and a batch of splices is thousands of short writes. QEMU handles
    /// the packets one after the other as they arrive, exactly as if each had waited.
    /// With acks on, the same where the stub takes a request before its last answer is
    /// acked (QEMU, whose gdbstub before 8.0 never turns acks off: one `+` per window);
    /// one packet at a time for any other stub.
    ///
    /// # Errors
    /// The index in `writes` of the first write the stub refused or that failed, and why.
    /// The answers to the rest of that window are read before returning (the writes
    /// before the failed one are done; those after it in the same window may be), and
    /// nothing more is sent.
    pub fn write_memory_batch(&mut self, writes: &[(u64, &[u8])]) -> Result<(), (usize, GdbError)> {
        let chunk = self.chunk();
        let mut requests = writes.iter().enumerate().flat_map(|(k, &(addr, data))| {
            data.chunks(chunk)
                .enumerate()
                .map(move |(i, part)| (k, addr.wrapping_add((i * chunk) as u64), part))
        });
        if self.ack_mode && !self.pipelines_with_acks {
            for (k, at, part) in requests {
                self.expect_ok(&format!("M{at:x},{:x}:{}", part.len(), to_hex(part)))
                    .map_err(|e| (k, e))?;
            }
            return Ok(());
        }
        let mut framed = Vec::with_capacity(PIPELINE_WINDOW + 2 * chunk + 64);
        // (index in `writes`, the request without its data) of each packet in flight.
        let mut in_flight: Vec<(usize, String)> = Vec::new();
        loop {
            let next = requests.next();
            if let Some((k, at, part)) = next {
                let head = format!("M{at:x},{:x}", part.len());
                let payload = format!("{head}:{}", to_hex(part));
                framed.extend_from_slice(&packet::encode(payload.as_bytes()));
                in_flight.push((k, head));
                self.packets += 1;
                if framed.len() < PIPELINE_WINDOW {
                    continue;
                }
            }
            let Some((first, _)) = in_flight.first() else {
                break;
            };
            self.write_raw(&framed, b"pipelined M packets")
                .map_err(|e| (*first, e))?;
            framed.clear();
            self.last_sent.clear();
            self.read_window(&mut in_flight)?;
            if next.is_none() {
                break;
            }
        }
        Ok(())
    }

    /// The answers to a window of pipelined `M` requests, in order (see
    /// [`Self::write_memory_batch`]); in ack mode one `+` at the end acks the last.
    fn read_window(
        &mut self,
        in_flight: &mut Vec<(usize, String)>,
    ) -> Result<(), (usize, GdbError)> {
        let deadline = Deadline::after(self.timeout);
        let mut failed = None;
        let last = in_flight.last().map_or(0, |r| r.0);
        self.pipelining = self.ack_mode;
        let mut result = Ok(());
        for (k, head) in in_flight.drain(..) {
            let answer = self
                .answer(&deadline, &head, false)
                .and_then(|reply| reply_text(&head, &reply))
                .and_then(|text| ok_reply(&head, &text));
            match answer {
                Ok(()) => {}
                // The stream holds no more answers we can trust.
                Err(e)
                    if !matches!(
                        e,
                        GdbError::Refused { .. }
                            | GdbError::Unexpected { .. }
                            | GdbError::Unsupported(_)
                    ) =>
                {
                    result = Err((k, e));
                    break;
                }
                Err(e) => {
                    failed.get_or_insert((k, e));
                }
            }
        }
        let acked = self.end_window().map_err(|e| (last, e));
        result?;
        acked?;
        failed.map_or(Ok(()), Err)
    }

    /// Ends reading a pipelined window's answers: in ack mode one `+` for the last. The ack
    /// matters beyond courtesy: QEMU drops an interrupt byte (0x03) that arrives while its
    /// last answer waits for one. Callers send it after a failure too, where it can be.
    fn end_window(&mut self) -> Result<(), GdbError> {
        self.pipelining = false;
        if self.ack_mode {
            self.write_raw(b"+", b"+")
        } else {
            Ok(())
        }
    }
}
