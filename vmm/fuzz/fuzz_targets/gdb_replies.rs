//! A hostile gdbstub: the fuzz input is the byte stream it sends, cut into pieces whose size
//! the first byte sets. Every packet the reader accepts goes through the reply parsers;
//! the reader must stay within its bounds whatever arrives.
#![no_main]

use exotap_vmm::gdb::client::{parse_stop_reply, parse_thread_id};
use exotap_vmm::gdb::packet::{from_hex, Frame, PacketReader, MAX_BODY, MAX_PAYLOAD};
use exotap_vmm::gdb::target::{collect_registers, includes};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&piece, stream)) = data.split_first() else {
        return;
    };
    let mut reader = PacketReader::new();
    for chunk in stream.chunks(usize::from(piece).max(1)) {
        reader.push(chunk);
        loop {
            match reader.next_frame() {
                Ok(Some(Frame::Packet(payload))) => {
                    assert!(payload.len() <= MAX_PAYLOAD);
                    let text = String::from_utf8_lossy(&payload);
                    let _ = parse_stop_reply(&text);
                    let _ = parse_thread_id(&text);
                    let _ = from_hex(&payload);
                    let _ = includes(&text);
                    let _ = collect_registers(&text, &mut Vec::new());
                }
                Ok(Some(Frame::Corrupt(_) | Frame::Nak)) => {}
                Ok(None) => break,
                Err(_) => return,
            }
        }
        assert!(reader.pending() <= MAX_BODY + 3);
    }
});
