//! `exotap run FILE` / `exotap -e SCRIPT`: the probe language front end (owned by the
//! language work; see probes/src/lang).
