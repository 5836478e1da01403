//! The rules of graph checkpoints (a graph framework's saved state, e.g. LangGraph's): the
//! arguments the SQL functions check before they touch a row.

use crate::error::{Code, LedgerError, Result};
use crate::ids;

/// The longest checkpoint namespace: LangGraph nests a subgraph's namespace in its parent's
/// (`parent:<id>|child:<id>`), so it is longer than a label; it is indexed, like a label.
pub const MAX_NAMESPACE_BYTES: usize = 1024;

/// A thread, checkpoint or task id of the framework: a label (free text up to 256 bytes).
pub fn check_name(argument: &str, value: Option<&str>) -> Result<String> {
    let value = value
        .filter(|v| !v.is_empty())
        .ok_or_else(|| LedgerError::required(argument))?;
    ids::validate_label(argument, value)?;
    Ok(value.to_owned())
}

/// A checkpoint namespace: NULL or empty is the root namespace (''); otherwise printable text of
/// at most 1024 bytes (22023 `LABEL_INVALID`).
pub fn check_namespace(value: Option<&str>) -> Result<String> {
    let value = value.unwrap_or("");
    if value.len() > MAX_NAMESPACE_BYTES
        || value.chars().any(|c| c.is_control() || ids::is_format(c))
    {
        return Err(LedgerError::new(
            Code::LabelInvalid,
            "checkpoint_ns must be printable text of at most 1024 bytes",
        )
        .with("argument", "checkpoint_ns"));
    }
    Ok(value.to_owned())
}

/// Parallel arrays that describe one list of values (channels, versions, types, bytes): all given
/// and of one length, without NULL names (22023 `GRAPH_BLOBS_INVALID`). Returns the length.
pub fn check_parallel(
    arrays: &[(&str, Option<usize>)],
    names: &[&[Option<String>]],
) -> Result<usize> {
    let invalid = |message: String| LedgerError::new(Code::GraphBlobsInvalid, message);
    let mut len = None;
    for (argument, n) in arrays {
        let n = n.ok_or_else(|| LedgerError::required(argument))?;
        match len {
            None => len = Some(n),
            Some(l) if l != n => {
                return Err(invalid(format!(
                    "{} must all have the same length",
                    arrays.iter().map(|a| a.0).collect::<Vec<_>>().join(", ")
                )))
            }
            Some(_) => {}
        }
    }
    if names.iter().any(|a| a.iter().any(Option::is_none)) {
        return Err(invalid(format!(
            "{} must hold no NULL",
            arrays
                .iter()
                .take(names.len())
                .map(|a| a.0)
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok(len.unwrap_or(0))
}

/// What `prune_graph_threads` keeps of each thread and namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// The newest checkpoint (with its writes and the values it names).
    KeepLatest,
    /// Nothing.
    Delete,
}

impl Strategy {
    /// `keep_latest` or `delete` (22023 `STRATEGY_UNKNOWN`).
    pub fn parse(value: Option<&str>) -> Result<Strategy> {
        match value {
            None => Err(LedgerError::required("strategy")),
            Some("keep_latest") => Ok(Strategy::KeepLatest),
            Some("delete") => Ok(Strategy::Delete),
            Some(other) => Err(LedgerError::new(
                Code::StrategyUnknown,
                "strategy must be keep_latest or delete",
            )
            .with("strategy", other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_namespaces() {
        assert_eq!(check_name("thread_id", Some("t 1")).unwrap(), "t 1");
        assert_eq!(
            check_name("thread_id", None).unwrap_err().code,
            Code::ArgumentRequired
        );
        assert_eq!(
            check_name("thread_id", Some("")).unwrap_err().code,
            Code::ArgumentRequired
        );
        assert_eq!(
            check_name("thread_id", Some("a\u{0}")).unwrap_err().code,
            Code::LabelInvalid
        );
        assert_eq!(check_namespace(None).unwrap(), "");
        assert_eq!(check_namespace(Some("a:1|b:2")).unwrap(), "a:1|b:2");
        assert_eq!(
            check_namespace(Some("a\nb")).unwrap_err().code,
            Code::LabelInvalid
        );
        let long = "n".repeat(MAX_NAMESPACE_BYTES + 1);
        assert_eq!(
            check_namespace(Some(&long)).unwrap_err().code,
            Code::LabelInvalid
        );
    }

    #[test]
    fn parallel_arrays_have_one_length() {
        let names = [Some("a".to_owned()), Some("b".to_owned())];
        assert_eq!(
            check_parallel(&[("channels", Some(2)), ("blobs", Some(2))], &[&names]).unwrap(),
            2
        );
        let e =
            check_parallel(&[("channels", Some(2)), ("blobs", Some(1))], &[&names]).unwrap_err();
        assert_eq!(e.code, Code::GraphBlobsInvalid);
        assert_eq!(
            check_parallel(&[("channels", None)], &[]).unwrap_err().code,
            Code::ArgumentRequired
        );
        let holed = [Some("a".to_owned()), None];
        let e =
            check_parallel(&[("channels", Some(2)), ("blobs", Some(2))], &[&holed]).unwrap_err();
        assert_eq!(e.code, Code::GraphBlobsInvalid);
    }

    #[test]
    fn strategies() {
        assert_eq!(
            Strategy::parse(Some("keep_latest")).unwrap(),
            Strategy::KeepLatest
        );
        assert_eq!(Strategy::parse(Some("delete")).unwrap(), Strategy::Delete);
        assert_eq!(
            Strategy::parse(Some("all")).unwrap_err().code,
            Code::StrategyUnknown
        );
        assert_eq!(
            Strategy::parse(None).unwrap_err().code,
            Code::ArgumentRequired
        );
    }
}
