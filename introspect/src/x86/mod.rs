//! x86-64 structural analysis: decoding, control-flow graphs and liveness.
