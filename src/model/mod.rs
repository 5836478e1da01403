//! Pure logic: no Postgres calls, tested with plain `#[test]`s.
pub mod args;
pub mod cost;
pub mod events;
pub mod evidence;
pub mod feed;
pub mod hash;
pub mod ids;
pub mod interrupt;
pub mod json;
pub mod outbox;
#[cfg(test)]
mod properties;
pub mod redact;
pub mod status;
pub mod text;
pub mod tool_call;
