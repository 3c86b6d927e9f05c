//! `exotap trace --perfetto FILE`: the trace records as a Perfetto trace (protobuf `Trace` of
//! `TracePacket`s), viewable in ui.perfetto.dev.
//!
//! One track per vCPU (a `TrackDescriptor` named `vCPU N`); each traced call is a slice on
//! the track of the vCPU it entered on: a `TYPE_SLICE_BEGIN` `TrackEvent` at the entry,
//! named after the function, with the task (`comm`), its pid and the first argument as debug
//! annotations, and a `TYPE_SLICE_END` at the return, with the return value. Timestamps are
//! nanoseconds since the first record, the same numbers the text output prints.
//!
//! The messages are declared here with `prost`'s derive, only the fields exotap writes, their
//! numbers those of Perfetto's own protos (`protos/perfetto/trace/trace.proto`,
//! `trace_packet.proto`, `track_event/{track_event,track_descriptor,debug_annotation}.proto`).
//! Protobuf readers skip what they do not know and need nothing exotap leaves out; the
//! end-to-end test decodes the files with Perfetto's own Python package
//! (`tests/perfetto_qemu.rs`). The generated crate of all of Perfetto's protos cost the build
//! a minute of a core for these five messages.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
#[cfg(test)]
use prost::Message as _;

/// `perfetto.protos.TracePacket`, the fields exotap writes.
#[derive(Clone, PartialEq, prost::Message)]
struct TracePacket {
    #[prost(uint64, optional, tag = "8")]
    timestamp: Option<u64>,
    /// `optional_trusted_packet_sequence_id`'s one member.
    #[prost(uint32, optional, tag = "10")]
    trusted_packet_sequence_id: Option<u32>,
    #[prost(message, optional, tag = "11")]
    track_event: Option<TrackEvent>,
    #[prost(message, optional, tag = "60")]
    track_descriptor: Option<TrackDescriptor>,
}

/// `perfetto.protos.TrackDescriptor`: a track's uuid and static name.
#[derive(Clone, PartialEq, prost::Message)]
struct TrackDescriptor {
    #[prost(uint64, optional, tag = "1")]
    uuid: Option<u64>,
    #[prost(string, optional, tag = "2")]
    name: Option<String>,
}

/// `perfetto.protos.TrackEvent.Type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, prost::Enumeration)]
#[repr(i32)]
enum EventType {
    SliceBegin = 1,
    SliceEnd = 2,
}

/// `perfetto.protos.TrackEvent`: a slice's begin or end on a track.
#[derive(Clone, PartialEq, prost::Message)]
struct TrackEvent {
    #[prost(message, repeated, tag = "4")]
    debug_annotations: Vec<DebugAnnotation>,
    #[prost(enumeration = "EventType", optional, tag = "9")]
    r#type: Option<i32>,
    #[prost(uint64, optional, tag = "11")]
    track_uuid: Option<u64>,
    /// `name_field`'s inline `name`.
    #[prost(string, optional, tag = "23")]
    name: Option<String>,
}

/// `perfetto.protos.DebugAnnotation`: a named value (`name_field`'s `name`, one member of
/// `value`).
#[derive(Clone, PartialEq, prost::Message)]
struct DebugAnnotation {
    #[prost(uint64, optional, tag = "3")]
    uint_value: Option<u64>,
    #[prost(int64, optional, tag = "4")]
    int_value: Option<i64>,
    #[prost(string, optional, tag = "6")]
    string_value: Option<String>,
    #[prost(string, optional, tag = "10")]
    name: Option<String>,
}

/// `perfetto.protos.Trace`: the file (decoded again by the tests).
#[cfg(test)]
#[derive(Clone, PartialEq, prost::Message)]
struct Trace {
    #[prost(message, repeated, tag = "1")]
    packet: Vec<TracePacket>,
}

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
}

fn annotation(name: &str) -> DebugAnnotation {
    DebugAnnotation {
        name: Some(name.to_owned()),
        ..DebugAnnotation::default()
    }
}

impl SliceTrace {
    /// A trace to be written to `path` at [`SliceTrace::finish`].
    pub fn new(path: &Path) -> Self {
        Self {
            path: path.to_owned(),
            bytes: Vec::new(),
            tracks: Vec::new(),
        }
    }

    /// Appends `packet` at `ts` as one `Trace.packet` field: a Trace is its packets' fields
    /// one after another.
    fn push(&mut self, mut packet: TracePacket, ts: u64) {
        packet.timestamp = Some(ts);
        packet.trusted_packet_sequence_id = Some(SEQUENCE);
        prost::encoding::message::encode(TRACE_PACKET_FIELD, &packet, &mut self.bytes);
    }

    fn track(&mut self, cpu: u32, ts: u64) -> u64 {
        let uuid = TRACK_BASE + u64::from(cpu);
        if !self.tracks.contains(&cpu) {
            self.tracks.push(cpu);
            let packet = TracePacket {
                track_descriptor: Some(TrackDescriptor {
                    uuid: Some(uuid),
                    name: Some(format!("vCPU {cpu}")),
                }),
                ..TracePacket::default()
            };
            self.push(packet, ts);
        }
        uuid
    }

    /// A call of `function` entered on vCPU `cpu` at `ts` ns by task `task` (`pid`), with
    /// first argument `arg0`.
    pub fn begin(&mut self, cpu: u32, ts: u64, function: &str, task: &str, pid: u32, arg0: u64) {
        let uuid = self.track(cpu, ts);
        let event = TrackEvent {
            r#type: Some(EventType::SliceBegin as i32),
            track_uuid: Some(uuid),
            name: Some(function.to_owned()),
            debug_annotations: vec![
                DebugAnnotation {
                    string_value: Some(task.to_owned()),
                    ..annotation("task")
                },
                DebugAnnotation {
                    int_value: Some(i64::from(pid)),
                    ..annotation("pid")
                },
                DebugAnnotation {
                    uint_value: Some(arg0),
                    ..annotation("arg0")
                },
            ],
        };
        self.event(event, ts);
    }

    /// The call last entered on vCPU `cpu`'s track returns at `ts` ns with `value`.
    pub fn end(&mut self, cpu: u32, ts: u64, value: u64) {
        let uuid = self.track(cpu, ts);
        let event = TrackEvent {
            r#type: Some(EventType::SliceEnd as i32),
            track_uuid: Some(uuid),
            name: None,
            debug_annotations: vec![DebugAnnotation {
                int_value: Some(value as i64),
                ..annotation("return")
            }],
        };
        self.event(event, ts);
    }

    fn event(&mut self, event: TrackEvent, ts: u64) {
        let packet = TracePacket {
            track_event: Some(event),
            ..TracePacket::default()
        };
        self.push(packet, ts);
    }

    /// Writes the file.
    ///
    /// # Errors
    /// When the file cannot be written.
    pub fn finish(self) -> anyhow::Result<()> {
        std::fs::write(&self.path, &self.bytes)
            .with_context(|| format!("cannot write {}", self.path.display()))
    }

    /// The packets written so far, decoded again (for tests).
    #[cfg(test)]
    fn packets(&self) -> Vec<TracePacket> {
        Trace::decode(self.bytes.as_slice()).unwrap().packet
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
        let track = packets[0].track_descriptor.as_ref().unwrap();
        assert_eq!(track.name.as_deref(), Some("vCPU 1"));
        let begin = packets[1].track_event.as_ref().unwrap();
        let end = packets[2].track_event.as_ref().unwrap();
        assert_eq!(
            (begin.r#type, begin.name.as_deref()),
            (Some(EventType::SliceBegin as i32), Some("vfs_read"))
        );
        assert_eq!(end.r#type, Some(EventType::SliceEnd as i32));
        assert_eq!(begin.track_uuid, track.uuid);
        assert_eq!(
            (packets[1].timestamp, packets[2].timestamp),
            (Some(100), Some(250))
        );
        let task = &begin.debug_annotations[0];
        assert_eq!(
            (task.name.as_deref(), task.string_value.as_deref()),
            (Some("task"), Some("dd"))
        );
        assert_eq!(end.debug_annotations[0].int_value, Some(18));
    }
}
