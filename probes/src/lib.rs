//! The instrumentation engine: splicing ([`splice`]), the JIT ([`jit`]) and the session with a
//! live guest ([`live`]) that installs what the layers below produce.
//!
//! The layers (docs/architecture.md), each its own crate, the arrows pointing down:
//! [`lang`] (exotap-lang: the SystemTap language to one checked program, and its interpreter)
//! -> [`compile`] (exotap-compile: that program's probe bodies to x86-64 code) -> this crate;
//! all of them on [`kernel_image`], [`rings`] and [`procfs`] (exotap-probes-base). They are
//! re-exported here under their old module names, so `exotap_probes::lang::...` names the
//! same items as `exotap_lang::...`.

pub use exotap_compile as compile;
pub use exotap_lang as lang;
pub use exotap_probes_base::{kernel_image, procfs, rings};

pub mod jit;
pub mod live;
pub mod splice;
