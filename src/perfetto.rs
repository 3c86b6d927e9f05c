//! `exotap trace --perfetto FILE`: the trace records as a Perfetto trace (protobuf `Trace` of
//! `TracePacket`s, written with the `perfetto_protos` crate's generated types), viewable in
//! ui.perfetto.dev.
//!
//! One track per vCPU (a `TrackDescriptor` named `vCPU N`); each traced call is a slice on
//! the track of the vCPU it entered on: a `TYPE_SLICE_BEGIN` `TrackEvent` at the entry,
//! named after the function, with the task (`comm`), its pid and the first argument as debug
//! annotations, and a `TYPE_SLICE_END` at the return, with the return value. Timestamps are
//! nanoseconds since the first record, the same numbers the text output prints.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use perfetto_protos::debug_annotation::DebugAnnotation;
use perfetto_protos::trace_packet::TracePacket;
use perfetto_protos::track_descriptor::TrackDescriptor;
use perfetto_protos::track_event::track_event::Type;
use perfetto_protos::track_event::TrackEvent;
use protobuf::CodedOutputStream;

/// The packet sequence every packet of the file belongs to.
const SEQUENCE: u32 = 1;
/// `Trace.packet`'s field number.
const TRACE_PACKET_FIELD: u32 = 1;
/// Track uuids: this plus the vCPU number.
const TRACK_BASE: u64 = 0x6578_6f74_6170_0000;

/// Slices being written to a Perfetto trace file.
#[derive(Debug)]
pub struct SliceTrace {
    path: PathBuf,
    /// The encoded `Trace` so far (a sequence of `packet` fields).
    bytes: Vec<u8>,
    /// vCPUs whose track is described already.
    tracks: Vec<u32>,
    /// The first failure to encode, reported at [`SliceTrace::finish`].
    failed: Option<String>,
}

fn annotation(name: &str) -> DebugAnnotation {
    let mut a = DebugAnnotation::new();
    a.set_name(name.to_owned());
    a
}

impl SliceTrace {
    /// A trace to be written to `path` at [`SliceTrace::finish`].
    pub fn new(path: &Path) -> Self {
        Self {
            path: path.to_owned(),
            bytes: Vec::new(),
            tracks: Vec::new(),
            failed: None,
        }
    }

    fn push(&mut self, mut packet: TracePacket, ts: u64) {
        packet.set_timestamp(ts);
        packet.set_trusted_packet_sequence_id(SEQUENCE);
        let mut out = CodedOutputStream::vec(&mut self.bytes);
        let written = out
            .write_message(TRACE_PACKET_FIELD, &packet)
            .and_then(|()| out.flush());
        if let Err(e) = written {
            self.failed.get_or_insert_with(|| e.to_string());
        }
    }

    fn track(&mut self, cpu: u32, ts: u64) -> u64 {
        let uuid = TRACK_BASE + u64::from(cpu);
        if !self.tracks.contains(&cpu) {
            self.tracks.push(cpu);
            let mut track = TrackDescriptor::new();
            track.set_uuid(uuid);
            track.set_name(format!("vCPU {cpu}"));
            let mut packet = TracePacket::new();
            packet.set_track_descriptor(track);
            self.push(packet, ts);
        }
        uuid
    }

    /// A call of `function` entered on vCPU `cpu` at `ts` ns by task `task` (`pid`), with
    /// first argument `arg0`.
    pub fn begin(&mut self, cpu: u32, ts: u64, function: &str, task: &str, pid: u32, arg0: u64) {
        let uuid = self.track(cpu, ts);
        let mut event = TrackEvent::new();
        event.set_type(Type::TYPE_SLICE_BEGIN);
        event.set_track_uuid(uuid);
        event.set_name(function.to_owned());
        let mut a = annotation("task");
        a.set_string_value(task.to_owned());
        event.debug_annotations.push(a);
        let mut a = annotation("pid");
        a.set_int_value(i64::from(pid));
        event.debug_annotations.push(a);
        let mut a = annotation("arg0");
        a.set_uint_value(arg0);
        event.debug_annotations.push(a);
        let mut packet = TracePacket::new();
        packet.set_track_event(event);
        self.push(packet, ts);
    }

    /// The call last entered on vCPU `cpu`'s track returns at `ts` ns with `value`.
    pub fn end(&mut self, cpu: u32, ts: u64, value: u64) {
        let uuid = self.track(cpu, ts);
        let mut event = TrackEvent::new();
        event.set_type(Type::TYPE_SLICE_END);
        event.set_track_uuid(uuid);
        let mut a = annotation("return");
        a.set_int_value(value as i64);
        event.debug_annotations.push(a);
        let mut packet = TracePacket::new();
        packet.set_track_event(event);
        self.push(packet, ts);
    }

    /// Writes the file.
    ///
    /// # Errors
    /// When a packet could not be encoded or the file written.
    pub fn finish(self) -> anyhow::Result<()> {
        if let Some(e) = self.failed {
            anyhow::bail!("cannot encode the Perfetto trace: {e}");
        }
        std::fs::write(&self.path, &self.bytes)
            .with_context(|| format!("cannot write {}", self.path.display()))
    }

    /// The packets written so far, decoded again (for tests).
    #[cfg(test)]
    fn packets(&self) -> Vec<TracePacket> {
        use protobuf::Message as _;
        let trace = perfetto_protos::trace::Trace::parse_from_bytes(&self.bytes).unwrap();
        trace.packet
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_is_a_begin_and_an_end_on_its_vcpus_described_track() {
        let mut trace = SliceTrace::new(Path::new("/nonexistent"));

        trace.begin(1, 100, "vfs_read", "dd", 42, 3);
        trace.end(1, 250, 18);
        let packets = trace.packets();

        assert_eq!(packets.len(), 3, "descriptor, begin, end");
        assert_eq!(packets[0].track_descriptor().name(), "vCPU 1");
        let (begin, end) = (packets[1].track_event(), packets[2].track_event());
        assert_eq!(
            (begin.type_(), begin.name()),
            (Type::TYPE_SLICE_BEGIN, "vfs_read")
        );
        assert_eq!(end.type_(), Type::TYPE_SLICE_END);
        assert_eq!(begin.track_uuid(), packets[0].track_descriptor().uuid());
        assert_eq!((packets[1].timestamp(), packets[2].timestamp()), (100, 250));
        assert_eq!(begin.debug_annotations[0].string_value(), "dd");
    }
}
