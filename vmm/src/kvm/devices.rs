//! The guest's legacy I/O ports: two 8250 UARTs (vm-superio), the i8042's reset line, the
//! CMOS index/data pair. Interrupts go to KVM's in-kernel PIC/IOAPIC through irqfds.
//!
//! | ports | device | IRQ |
//! |---|---|---|
//! | 0x3f8..0x400 | ttyS0: the console, copied to the host | 4 |
//! | 0x2f8..0x300 | ttyS1: the host's go channel (the guest reads one byte per wait) | 3 |
//! | 0x60, 0x64 | i8042: a write of 0xfe to 0x64 resets the machine (`reboot=k`) | - |
//! | 0x70, 0x71 | CMOS: reads 0 (the kernel reads the clock from kvmclock) | - |
//! | 0x600..0x604 | ACPI PM1a event block (PM1_STS, PM1_EN) | SCI 9, never raised |
//! | 0x604..0x606 | ACPI PM1a control: SCI_EN reads 1; `SLP_TYP=S5 \| SLP_EN` powers off | - |
//!
//! Any other port reads all-ones (no device) and ignores writes.

use std::io::Write;
use std::sync::mpsc::Sender;

use vm_superio::serial::NoEvents;
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use super::acpi::{PM1A_CNT, PM1A_EVT, PM1_SCI_EN, PM1_SLP_EN, PM1_SLP_TYP_SHIFT, S5_SLP_TYP};

/// First port of ttyS0.
pub const COM1: u16 = 0x3f8;
/// First port of ttyS1.
pub const COM2: u16 = 0x2f8;
/// ttyS0's IRQ.
pub const COM1_IRQ: u32 = 4;
/// ttyS1's IRQ.
pub const COM2_IRQ: u32 = 3;
/// i8042 data port.
pub const I8042_DATA: u16 = 0x60;
/// i8042 command/status port.
pub const I8042_COMMAND: u16 = 0x64;
/// The i8042 command that pulses the CPU reset line.
pub const I8042_RESET: u8 = 0xfe;
/// CMOS index port.
pub const CMOS_INDEX: u16 = 0x70;
/// CMOS data port.
pub const CMOS_DATA: u16 = 0x71;

/// Raises an interrupt by writing an eventfd that KVM has as an irqfd.
#[derive(Debug)]
pub struct IrqTrigger(pub EventFd);

impl Trigger for IrqTrigger {
    type E = std::io::Error;

    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

/// ttyS0's output: bytes go to the host's console reader.
#[derive(Debug)]
pub struct ConsoleOut(pub Sender<Vec<u8>>);

impl Write for ConsoleOut {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // The reader gone means the run is over; the guest's output has nowhere to go.
        let _ = self.0.send(buf.to_vec());
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What a port access does beyond the device's own state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoEffect {
    /// Nothing.
    None,
    /// The guest reset the machine (i8042 reset).
    Reset,
    /// The guest entered ACPI S5 (soft-off).
    PowerOff,
}

/// The ACPI PM1a registers (PM1_STS and PM1_EN at [`PM1A_EVT`], PM1_CNT at [`PM1A_CNT`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pm1 {
    /// PM1_EN (PM1_STS always reads 0: no event is ever pending).
    pub enable: u16,
    /// PM1_CNT without SLP_EN (write-only, reads 0).
    pub control: u16,
}

impl Pm1 {
    /// Whether `port` is one of the PM1a registers' bytes.
    pub fn owns(port: u16) -> bool {
        (PM1A_EVT..PM1A_EVT + 4).contains(&port) || (PM1A_CNT..PM1A_CNT + 2).contains(&port)
    }

    /// The bytes of the PM1a registers as one little-endian image, from [`PM1A_EVT`].
    fn image(&self) -> [u8; 6] {
        let mut b = [0u8; 6];
        b[2..4].copy_from_slice(&self.enable.to_le_bytes());
        b[4..6].copy_from_slice(&(self.control | PM1_SCI_EN).to_le_bytes());
        b
    }

    /// A read of `data.len()` bytes at `port`.
    pub fn read(&self, port: u16, data: &mut [u8]) {
        let image = self.image();
        for (i, d) in data.iter_mut().enumerate() {
            let at = usize::from(port - PM1A_EVT) + i;
            *d = image.get(at).copied().unwrap_or(0xff);
        }
    }

    /// A write of `data` at `port`; says whether the guest powered off.
    pub fn write(&mut self, port: u16, data: &[u8]) -> IoEffect {
        let mut image = self.image();
        for (i, d) in data.iter().enumerate() {
            let at = usize::from(port - PM1A_EVT) + i;
            if (2..6).contains(&at) {
                image[at] = *d;
            }
        }
        self.enable = u16::from_le_bytes([image[2], image[3]]);
        let control = u16::from_le_bytes([image[4], image[5]]);
        let touched_control = data
            .iter()
            .enumerate()
            .any(|(i, _)| usize::from(port - PM1A_EVT) + i >= 4);
        if touched_control && control & PM1_SLP_EN != 0 {
            let slp_typ = (control >> PM1_SLP_TYP_SHIFT) & 0x7;
            self.control = control & !PM1_SLP_EN;
            if slp_typ == S5_SLP_TYP {
                return IoEffect::PowerOff;
            }
            // Other sleep states are not offered (the DSDT names only \_S5_).
            return IoEffect::None;
        }
        self.control = control;
        IoEffect::None
    }
}

/// The port-mapped devices, shared by the vCPUs behind one lock.
pub struct Devices {
    console: Serial<IrqTrigger, NoEvents, ConsoleOut>,
    go: Serial<IrqTrigger, NoEvents, std::io::Sink>,
    cmos_index: u8,
    pm1: Pm1,
}

impl std::fmt::Debug for Devices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Devices")
            .field("cmos_index", &self.cmos_index)
            .finish_non_exhaustive()
    }
}

/// The 8250's interrupt enable register's offset.
const UART_IER: u8 = 1;
/// The 8250's line status register's offset.
const UART_LSR: u8 = 5;

/// Which device a port belongs to.
fn serial_offset(port: u16, base: u16) -> Option<u8> {
    port.checked_sub(base).filter(|o| *o < 8).map(|o| o as u8)
}

impl Devices {
    /// The devices, with the UARTs' interrupts on the given eventfds.
    pub fn new(console_irq: EventFd, go_irq: EventFd, console: Sender<Vec<u8>>) -> Self {
        Self {
            console: Serial::new(IrqTrigger(console_irq), ConsoleOut(console)),
            go: Serial::new(IrqTrigger(go_irq), std::io::sink()),
            cmos_index: 0,
            pm1: Pm1::default(),
        }
    }

    /// An `in` of one access of `data.len()` bytes (1, 2 or 4) from `port`. Byte-wide
    /// devices see each byte as a read of `port`, as `rep insb` does.
    pub fn access_in(&mut self, port: u16, data: &mut [u8]) {
        if Pm1::owns(port) && data.len() <= 4 {
            self.pm1.read(port, data);
        } else {
            for chunk in data.chunks_mut(1) {
                self.io_in(port, chunk);
            }
        }
    }

    /// An `out` of one access of `data` to `port` (see [`Devices::access_in`]).
    pub fn access_out(&mut self, port: u16, data: &[u8]) -> IoEffect {
        if Pm1::owns(port) && data.len() <= 4 {
            return self.pm1.write(port, data);
        }
        for chunk in data.chunks(1) {
            let effect = self.io_out(port, chunk);
            if effect != IoEffect::None {
                return effect;
            }
        }
        IoEffect::None
    }

    /// An `in` of `data.len()` bytes from `port`.
    pub fn io_in(&mut self, port: u16, data: &mut [u8]) {
        let value = if let Some(off) = serial_offset(port, COM1) {
            self.console.read(off)
        } else if let Some(off) = serial_offset(port, COM2) {
            self.go.read(off)
        } else {
            match port {
                // Status: output buffer empty, input buffer empty: nothing to read, ready.
                I8042_COMMAND | I8042_DATA => 0,
                CMOS_DATA => 0,
                CMOS_INDEX => self.cmos_index,
                _ => 0xff,
            }
        };
        data.fill(value);
    }

    /// An `out` of `data` to `port`.
    pub fn io_out(&mut self, port: u16, data: &[u8]) -> IoEffect {
        let Some(&value) = data.first() else {
            return IoEffect::None;
        };
        if let Some(off) = serial_offset(port, COM1) {
            if let Err(e) = self.console.write(off, value) {
                tracing::debug!("ttyS0 write failed: {e:?}");
            }
        } else if let Some(off) = serial_offset(port, COM2) {
            if let Err(e) = self.go.write(off, value) {
                tracing::debug!("ttyS1 write failed: {e:?}");
            }
        } else {
            match port {
                I8042_COMMAND if value == I8042_RESET => return IoEffect::Reset,
                CMOS_INDEX => self.cmos_index = value & 0x7f,
                _ => {}
            }
        }
        IoEffect::None
    }

    /// Both UARTs' interrupt enable and line status registers (reads without side effects),
    /// e.g. `ttyS0 IER 0x02 LSR 0x60`: IER bit 1 set with nothing arriving is a driver that
    /// waits for a transmit interrupt.
    pub fn uart_state(&mut self) -> String {
        let one = |name: &str, read: &mut dyn FnMut(u8) -> u8| {
            format!(
                "{name} IER {:#04x} LSR {:#04x}",
                read(UART_IER),
                read(UART_LSR)
            )
        };
        let console = one("ttyS0 (console)", &mut |off| self.console.read(off));
        let go = one("ttyS1 (go)", &mut |off| self.go.read(off));
        format!("{console}; {go}")
    }

    /// Puts bytes into ttyS1's receive FIFO (the host's go).
    ///
    /// # Errors
    /// When the FIFO is full or the interrupt cannot be raised.
    pub fn send_go(&mut self, bytes: &[u8]) -> Result<(), String> {
        self.go
            .enqueue_raw_bytes(bytes)
            .map(drop)
            .map_err(|e| format!("{e:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn devices() -> (Devices, mpsc::Receiver<Vec<u8>>) {
        let (tx, rx) = mpsc::channel();
        let evt = || EventFd::new(libc::EFD_NONBLOCK).unwrap();
        (Devices::new(evt(), evt(), tx), rx)
    }

    #[test]
    fn bytes_written_to_ttys0_reach_the_console() {
        let (mut d, rx) = devices();

        for b in b"hi\n" {
            assert_eq!(d.io_out(COM1, &[*b]), IoEffect::None);
        }

        let got: Vec<u8> = rx.try_iter().flatten().collect();
        assert_eq!(got, b"hi\n");
    }

    #[test]
    fn go_byte_is_readable_from_ttys1() {
        let (mut d, _rx) = devices();
        d.send_go(b"g").unwrap();
        let mut lsr = [0u8];
        let mut rbr = [0u8];

        d.io_in(COM2 + 5, &mut lsr);
        d.io_in(COM2, &mut rbr);

        assert_eq!(lsr[0] & 1, 1, "data ready");
        assert_eq!(rbr[0], b'g');
    }

    #[test]
    fn uart_state_shows_what_the_driver_enabled_and_reading_it_changes_nothing() {
        let (mut d, _rx) = devices();
        // The 8250 driver waiting for a transmit interrupt: IER.THRI (bit 1).
        d.io_out(COM1 + 1, &[0x02]);
        d.send_go(b"g").unwrap();

        let state = d.uart_state();
        assert_eq!(
            state,
            d.uart_state(),
            "reading the state twice gives the same"
        );

        assert!(state.contains("ttyS0 (console) IER 0x02"), "{state}");
        // ttyS1: a byte waiting (LSR.DR, bit 0), the transmitter empty (bits 5 and 6).
        assert!(state.contains("ttyS1 (go) IER 0x00 LSR 0x61"), "{state}");
        let mut rbr = [0u8];
        d.io_in(COM2, &mut rbr);
        assert_eq!(rbr[0], b'g', "the waiting byte is still there");
    }

    #[test]
    fn i8042_reset_command_resets() {
        let (mut d, _rx) = devices();

        assert_eq!(d.io_out(I8042_COMMAND, &[0xfe]), IoEffect::Reset);
        assert_eq!(d.io_out(I8042_COMMAND, &[0xaa]), IoEffect::None);
    }

    #[test]
    fn pm1_control_reads_sci_en_and_s5_sleep_powers_off() {
        // ACPI 6.4, 4.8.3.2.1: PM1_CNT bit 0 SCI_EN, bits 10-12 SLP_TYP, bit 13 SLP_EN.
        let (mut d, _rx) = devices();
        let mut cnt = [0u8; 2];

        d.access_in(0x604, &mut cnt);
        assert_eq!(u16::from_le_bytes(cnt) & 1, 1, "SCI_EN: in ACPI mode");
        // What ACPICA does for S5: SLP_TYP first, then SLP_TYP | SLP_EN.
        assert_eq!(
            d.access_out(0x604, &0x0001u16.to_le_bytes()),
            IoEffect::None
        );
        assert_eq!(
            d.access_out(0x604, &(0x0001u16 | 1 << 13).to_le_bytes()),
            IoEffect::PowerOff
        );
    }

    #[test]
    fn pm1_other_sleep_types_and_enable_writes_do_not_power_off() {
        let (mut d, _rx) = devices();
        let mut en = [0u8; 2];

        assert_eq!(
            d.access_out(0x604, &((1u16 << 10) | (1 << 13)).to_le_bytes()),
            IoEffect::None,
            "SLP_TYP 1 is not offered"
        );
        assert_eq!(
            d.access_out(0x602, &0x0100u16.to_le_bytes()),
            IoEffect::None
        );
        d.access_in(0x602, &mut en);
        assert_eq!(
            u16::from_le_bytes(en),
            0x0100,
            "PM1_EN keeps what was written"
        );
        let mut sts = [0xffu8; 4];
        d.access_in(0x600, &mut sts);
        assert_eq!(&sts[..2], &[0, 0], "PM1_STS: nothing pending");
    }

    #[test]
    fn absent_ports_read_all_ones_and_cmos_reads_zero() {
        let (mut d, _rx) = devices();
        let mut absent = [0u8; 2];
        let mut cmos = [0xffu8];

        d.io_in(0x3e8, &mut absent);
        d.io_out(CMOS_INDEX, &[0x0a]);
        d.io_in(CMOS_DATA, &mut cmos);

        assert_eq!(absent, [0xff, 0xff]);
        assert_eq!(cmos, [0]);
    }
}
