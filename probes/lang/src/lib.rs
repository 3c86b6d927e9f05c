//! The probe language: a SystemTap-like script language.
//!
//! The pipeline is the one rhai lays out: [`lexer`] turns bytes into tokens, [`parser`] builds
//! the [`ast`] (every node carries a [`ast::Span`]), [`check`] resolves names and infers types,
//! and [`eval`] runs probe bodies on the host, either for guest-free probes (`begin`, `end`,
//! timers) or on a [`context::Context`] captured by a kernel backend. [`diag`] renders
//! diagnostics with the source line and a caret; [`format`](mod@format) implements printf
//! formats and [`hist`] the SystemTap histogram layout; [`output`] writes text or JSON lines.

pub mod ast;
pub mod builtins;
pub mod check;
mod check_expr;
mod check_stmt;
pub mod context;
pub mod diag;
pub mod driver;
pub mod eval;
pub mod eval_call;
mod eval_expr;
pub mod facts;
pub mod format;
pub mod hist;
pub mod invocation;
pub mod kernel_points;
pub mod lexer;
pub mod limits;
pub mod native;
pub mod output;
pub mod parser;
pub mod point;
pub mod resolve;
pub mod runtime;
pub mod source_lines;
pub mod syscalls;
pub mod tapset;
pub mod value;
pub mod walk;

pub use limits::Limits;
