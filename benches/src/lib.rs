//! Criterion benchmarks for idem; the benchmarks themselves live in `benches/`.
