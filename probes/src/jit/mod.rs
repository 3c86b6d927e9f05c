//! JIT instrumentation (DESIGN.md, key mechanism 5): kernel functions translated block by
//! block into a code cache in the patch heap, with a counter inlined at every block
//! leader, entered through a splice at the function's entry.
//!
//! [`cache`] places the cache's parts in the heap; [`lookup`] is the in-guest table and
//! the dispatch routine that returns and indirect branches go through; [`translate`]
//! turns functions into linked translations (see its documentation for the choices:
//! original return addresses, where code leaves the cache, flags, a full cache).

pub mod cache;
pub mod lookup;
pub mod translate;

pub use cache::{CacheError, CacheLayout};
pub use lookup::{dispatch_routine, LookupError, LookupTable};
pub use translate::{
    entry_splice, CacheExit, CountedBlock, ExitReason, TranslateError, TranslatedFunction,
    Translation, Translator,
};

// Detaching (not built yet, issue 18): remove the entry splices (text byte-identical),
// then zero the lookup table so every return and indirect branch in the cache continues
// at its original target, then wait until no vCPU's RIP is in the cache; only then may
// the heap be reused. Stacks hold original return addresses only, so a sleeping task
// never returns into the cache.
