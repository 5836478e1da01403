//! The rules of graph checkpoints (a graph framework's saved state, e.g. LangGraph's): the
//! arguments the SQL functions check before they touch a row.

use crate::error::{Code, LedgerError, Result};
use crate::ids;

/// The longest checkpoint namespace: LangGraph nests a subgraph's namespace in its parent's
/// (`parent:<id>|child:<id>`), so it is longer than a label; it is indexed, like a label.
pub const MAX_NAMESPACE_BYTES: usize = 1024;

/// A checkpoint namespace (or a task path, its kind): NULL or empty is the root (''); otherwise
/// printable text of at most 1024 bytes (22023 `LABEL_INVALID`).
pub fn check_namespace(argument: &str, value: Option<&str>) -> Result<String> {
    let value = value.unwrap_or("");
    if value.len() > MAX_NAMESPACE_BYTES
        || value.chars().any(|c| c.is_control() || ids::is_format(c))
    {
        return Err(LedgerError::new(
            Code::LabelInvalid,
            format!("{argument} must be printable text of at most {MAX_NAMESPACE_BYTES} bytes"),
        )
        .with("argument", argument)
        .with("bytes", value.len()));
    }
    Ok(value.to_owned())
}

/// Parallel arrays that describe one list of values (channels, versions, types, bytes): all given
/// and of one length (22023 `GRAPH_BLOBS_INVALID`), the names among them without NULL
/// (`GRAPH_BLOBS_INVALID`) and each a label (`LABEL_INVALID`). Returns the length.
pub fn check_parallel(
    lengths: &[(&str, Option<usize>)],
    names: &[(&str, &[Option<String>])],
) -> Result<usize> {
    let arguments = || lengths.iter().map(|a| a.0).collect::<Vec<_>>().join(", ");
    let mut len = None;
    for (argument, n) in lengths {
        let n = n.ok_or_else(|| LedgerError::required(argument))?;
        if len.is_some_and(|l| l != n) {
            return Err(LedgerError::new(
                Code::GraphBlobsInvalid,
                format!("{} must all have the same length", arguments()),
            ));
        }
        len = Some(n);
    }
    for (argument, list) in names {
        for name in *list {
            let name = name.as_deref().ok_or_else(|| {
                LedgerError::new(
                    Code::GraphBlobsInvalid,
                    format!("{argument} must hold no NULL"),
                )
                .with("argument", *argument)
            })?;
            ids::validate_label(argument, name)?;
        }
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
            Some(_) => Err(LedgerError::new(
                Code::StrategyUnknown,
                "strategy must be keep_latest or delete",
            )
            .with("argument", "strategy")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces() {
        assert_eq!(check_namespace("checkpoint_ns", None).unwrap(), "");
        assert_eq!(
            check_namespace("checkpoint_ns", Some("a:1|b:2")).unwrap(),
            "a:1|b:2"
        );
        let e = check_namespace("task_path", Some("a\nb")).unwrap_err();
        assert_eq!(
            (e.code, &e.detail["argument"]),
            (Code::LabelInvalid, &"task_path".into())
        );
        let long = "n".repeat(MAX_NAMESPACE_BYTES + 1);
        let e = check_namespace("checkpoint_ns", Some(&long)).unwrap_err();
        assert_eq!(
            (e.code, &e.detail["bytes"]),
            (Code::LabelInvalid, &1025.into())
        );
    }

    #[test]
    fn parallel_arrays_have_one_length_and_named_entries() {
        let names = [Some("a".to_owned()), Some("b".to_owned())];
        let two = [("channels", Some(2)), ("blobs", Some(2))];
        assert_eq!(check_parallel(&two, &[("channels", &names)]).unwrap(), 2);
        let uneven = [("channels", Some(2)), ("blobs", Some(1))];
        let e = check_parallel(&uneven, &[("channels", &names)]).unwrap_err();
        assert_eq!(e.code, Code::GraphBlobsInvalid);
        let e = check_parallel(&[("channels", None)], &[]).unwrap_err();
        assert_eq!(e.code, Code::ArgumentRequired);
        let holed = [Some("a".to_owned()), None];
        let e = check_parallel(&two, &[("channels", &holed)]).unwrap_err();
        assert_eq!(e.code, Code::GraphBlobsInvalid);
        let long = [Some("x".repeat(300)), Some("b".to_owned())];
        let e = check_parallel(&two, &[("channels", &long)]).unwrap_err();
        assert_eq!(
            (e.code, &e.detail["argument"]),
            (Code::LabelInvalid, &"channels".into())
        );
    }

    #[test]
    fn strategies() {
        assert_eq!(
            Strategy::parse(Some("keep_latest")).unwrap(),
            Strategy::KeepLatest
        );
        assert_eq!(Strategy::parse(Some("delete")).unwrap(), Strategy::Delete);
        let e = Strategy::parse(Some("all")).unwrap_err();
        assert_eq!(
            (e.code, e.detail.values().any(|v| v == "all")),
            (Code::StrategyUnknown, false)
        );
        assert_eq!(
            Strategy::parse(None).unwrap_err().code,
            Code::ArgumentRequired
        );
    }
}
