//! Guest images: Debian kernel packages fetched and cached, initramfs built in Rust, and the
//! workload programs compiled from `guest-images/workloads/*.c`.
