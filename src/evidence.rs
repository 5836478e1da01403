//! The evidence of a run: what writers record against it (`records`: audits, response events,
//! citations, feedback; `costs`), and what readers make of it (`bundle`: the replay bundle,
//! `run_evidence`, `replay_ready`; `otel`: the run as an OpenTelemetry trace).

mod bundle;
mod costs;
mod otel;
mod records;
