//! Run leases: the rules of a run's fencing token (the `run_token` argument of the run's
//! writes) and of claims across scopes. Lease lengths follow the outbox's and the tool calls'
//! rules (`outbox::lease_seconds`, `tool_calls::extend_seconds`).

use crate::error::{Code, LedgerError, Result};

/// The run's fencing token as read under its lock: `current` (+ 1 on every claim) and whether
/// an owner holds the run (`held`: claimed and neither released nor taken over since).
///
/// A write that carries no token is not fenced (callers that never claim runs work as before).
/// One that carries a token must carry the current one while the run is held: 40001
/// `LEASE_STALE` otherwise, also for a released run's last token. The lease's clock plays no
/// part: an owner whose lease expired keeps writing until someone takes the run over.
pub fn check_token(run_id: &str, given: Option<i64>, current: i64, held: bool) -> Result<()> {
    let Some(given) = given else {
        return Ok(());
    };
    if given == current && held {
        return Ok(());
    }
    let message = if given == current {
        format!("run_token {given} is over: the run was released; claim it again")
    } else {
        format!("run_token {given} is not the run's current token ({current}): the run was claimed again since")
    };
    Err(LedgerError::new(Code::LeaseStale, message)
        .with("run_id", run_id)
        .with("run_token", given)
        .with("current_run_token", current)
        .with("lease_released", given == current && !held))
}

/// What a claim with `any_scope` needs: membership of `ledger_operator` (42501
/// `OPERATOR_REQUIRED`), and no `run_id` (ids are unique per scope only: 22023
/// `ARGUMENT_CONFLICT`).
pub fn check_any_scope(is_operator: bool, run_id: Option<&str>) -> Result<()> {
    if !is_operator {
        return Err(LedgerError::new(
            Code::OperatorRequired,
            "any_scope => true is for members of ledger_operator",
        )
        .with("role", "ledger_operator"));
    }
    if run_id.is_some() {
        return Err(LedgerError::new(
            Code::ArgumentConflict,
            "run_id names a run of the current scope; any_scope => true claims the oldest claimable run of every scope",
        )
        .with("argument", "run_id"));
    }
    Ok(())
}

/// The highest and lowest priority of a run: `claim_run` hands out higher priorities first.
pub const MAX_PRIORITY: i32 = 1000;

/// A run's `priority`, -1000 to 1000 (default 0; 22023 `PRIORITY_INVALID` otherwise).
pub fn priority(given: Option<i32>) -> Result<i32> {
    let p = given.unwrap_or(0);
    if !(-MAX_PRIORITY..=MAX_PRIORITY).contains(&p) {
        return Err(LedgerError::new(
            Code::PriorityInvalid,
            "priority must be between -1000 and 1000",
        )
        .with("priority", p));
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Class;

    #[test]
    fn no_token_is_not_fenced_and_only_the_current_held_token_passes() {
        assert!(check_token("r", None, 7, false).is_ok());
        assert!(check_token("r", None, 0, false).is_ok());
        assert!(check_token("r", Some(3), 3, true).is_ok());
        let e = check_token("r", Some(2), 3, true).unwrap_err();
        assert_eq!((e.class(), e.code), (Class::Conflict, Code::LeaseStale));
        assert_eq!(e.detail["run_token"], 2);
        assert_eq!(e.detail["current_run_token"], 3);
        assert_eq!(e.detail["lease_released"], false);
        // A released run's last token is over too, and a run nobody claimed has no valid token.
        let e = check_token("r", Some(3), 3, false).unwrap_err();
        assert_eq!(e.code, Code::LeaseStale);
        assert_eq!(e.detail["lease_released"], true);
        assert!(check_token("r", Some(0), 0, false).is_err());
        // A token from the future is stale as well (it was never issued).
        assert!(check_token("r", Some(4), 3, true).is_err());
    }

    #[test]
    fn any_scope_is_for_operators_and_names_no_run() {
        assert!(check_any_scope(true, None).is_ok());
        let e = check_any_scope(false, None).unwrap_err();
        assert_eq!(
            (e.class(), e.code),
            (Class::Privilege, Code::OperatorRequired)
        );
        let e = check_any_scope(true, Some("r")).unwrap_err();
        assert_eq!(
            (e.class(), e.code),
            (Class::InvalidParameter, Code::ArgumentConflict)
        );
    }

    #[test]
    fn priority_defaults_to_zero_and_stays_within_a_thousand_either_way() {
        assert_eq!(priority(None), Ok(0));
        assert_eq!(priority(Some(-1000)), Ok(-1000));
        assert_eq!(priority(Some(1000)), Ok(1000));
        for p in [1001, -1001, i32::MIN, i32::MAX] {
            let e = priority(Some(p)).unwrap_err();
            assert_eq!(
                (e.class(), e.code),
                (Class::InvalidParameter, Code::PriorityInvalid)
            );
            assert_eq!(e.detail["priority"], p);
        }
    }
}
