//! The status machine of runs, steps and tasks (their transition tables), as data.

use crate::error::{Class, LedgerError, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    Queued,
    Preparing,
    Running,
    WaitingInput,
    WaitingApproval,
    Paused,
    Retrying,
    Succeeded,
    Failed,
    Canceled,
    Expired,
    /// Steps only.
    Skipped,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resource {
    Run,
    Step,
    Task,
}

use Status::*;

impl Status {
    /// The eleven execution statuses, then `skipped`.
    pub const ALL: [Status; 12] = [
        Queued,
        Preparing,
        Running,
        WaitingInput,
        WaitingApproval,
        Paused,
        Retrying,
        Succeeded,
        Failed,
        Canceled,
        Expired,
        Skipped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Queued => "queued",
            Preparing => "preparing",
            Running => "running",
            WaitingInput => "waiting_input",
            WaitingApproval => "waiting_approval",
            Paused => "paused",
            Retrying => "retrying",
            Succeeded => "succeeded",
            Failed => "failed",
            Canceled => "canceled",
            Expired => "expired",
            Skipped => "skipped",
        }
    }

    pub fn is_terminal(self) -> bool {
        matches!(self, Succeeded | Failed | Canceled | Expired | Skipped)
    }

    /// Statuses that mean the work has begun (first entry sets `started_at`).
    pub fn is_started(self) -> bool {
        matches!(self, Preparing | Running)
    }

    /// Parses a status of `resource`; unknown names (and `skipped` outside steps) are refused.
    pub fn parse(resource: Resource, name: &str) -> Result<Status> {
        Status::ALL
            .into_iter()
            .find(|s| s.as_str() == name && resource.has(*s))
            .ok_or_else(|| {
                // Echo at most 64 characters of a bad value back (it may be megabytes).
                let shown = crate::text::truncate_chars(name, 64);
                LedgerError::invalid(
                    "STATUS_UNKNOWN",
                    format!("unknown {} status: {shown:?}", resource.as_str()),
                )
                .with("resource", resource.as_str())
                .with("status", shown)
            })
    }
}

impl Resource {
    pub const ALL: [Resource; 3] = [Resource::Run, Resource::Step, Resource::Task];

    pub fn as_str(self) -> &'static str {
        match self {
            Resource::Run => "run",
            Resource::Step => "step",
            Resource::Task => "task",
        }
    }

    pub fn has(self, status: Status) -> bool {
        status != Skipped || self == Resource::Step
    }

    /// The statuses `from` may move to. Runs and tasks share one table; steps add `skipped`
    /// from `queued` and `preparing`.
    pub fn targets(self, from: Status) -> &'static [Status] {
        let step = self == Resource::Step;
        match from {
            Queued if step => &[Preparing, Running, Failed, Canceled, Expired, Skipped],
            Queued => &[Preparing, Running, Failed, Canceled, Expired],
            Preparing if step => &[
                Running,
                WaitingInput,
                WaitingApproval,
                Paused,
                Succeeded,
                Failed,
                Canceled,
                Expired,
                Skipped,
            ],
            Preparing => &[
                Running,
                WaitingInput,
                WaitingApproval,
                Paused,
                Succeeded,
                Failed,
                Canceled,
                Expired,
            ],
            Running => &[
                WaitingInput,
                WaitingApproval,
                Paused,
                Succeeded,
                Failed,
                Canceled,
                Expired,
            ],
            WaitingInput | WaitingApproval => &[Running, Failed, Canceled, Expired],
            Paused => &[Running, Canceled, Expired],
            Retrying => &[Queued, Preparing, Running, Failed, Canceled, Expired],
            Failed | Canceled | Expired => &[Retrying],
            Succeeded | Skipped => &[],
        }
    }

    pub fn allows(self, from: Status, to: Status) -> bool {
        self.targets(from).contains(&to)
    }

    /// Refuses a move the table does not allow (55000 `TRANSITION_INVALID`).
    pub fn check(self, from: Status, to: Status) -> Result<()> {
        if self.allows(from, to) {
            return Ok(());
        }
        Err(LedgerError::new(
            Class::WrongState,
            "TRANSITION_INVALID",
            format!(
                "invalid {} transition: {} -> {}",
                self.as_str(),
                from.as_str(),
                to.as_str()
            ),
        )
        .with("resource", self.as_str())
        .with("from", from.as_str())
        .with("to", to.as_str()))
    }

    /// Every allowed (from, to) pair, in table order.
    pub fn transitions(self) -> impl Iterator<Item = (Status, Status)> {
        Status::ALL
            .into_iter()
            .filter(move |s| self.has(*s))
            .flat_map(move |from| self.targets(from).iter().map(move |to| (from, *to)))
    }
}

/// 40001 `TRANSITION_CONFLICT`: the row was no longer at `expected`.
pub fn conflict(resource: Resource, id: &str, expected: Status, to: Status) -> LedgerError {
    LedgerError::new(
        Class::Conflict,
        "TRANSITION_CONFLICT",
        format!(
            "concurrent {} transition rejected: {} was no longer {}",
            resource.as_str(),
            id,
            expected.as_str()
        ),
    )
    .with("resource", resource.as_str())
    .with("id", id)
    .with("expected", expected.as_str())
    .with("to", to.as_str())
}

/// Decides a transition of a locked row at `current`. `Ok(None)` means the row is
/// already at `to` (idempotent: nothing changes); `Ok(Some(from))` means update from `from`.
pub fn check_transition(
    resource: Resource,
    id: &str,
    current: Status,
    expected: Option<Status>,
    to: Status,
) -> Result<Option<Status>> {
    if current == to {
        return Ok(None);
    }
    if let Some(expected) = expected {
        if expected != current {
            return Err(conflict(resource, id, expected, to).with("actual", current.as_str()));
        }
    }
    resource.check(current, to)?;
    Ok(Some(current))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(resource: Resource) -> Vec<(&'static str, Vec<&'static str>)> {
        Status::ALL
            .into_iter()
            .filter(|s| resource.has(*s))
            .map(|s| {
                (
                    s.as_str(),
                    resource.targets(s).iter().map(|t| t.as_str()).collect(),
                )
            })
            .collect()
    }

    /// The run table, written out independently of the match above.
    const RUN_TABLE: [(&str, &[&str]); 11] = [
        (
            "queued",
            &["preparing", "running", "failed", "canceled", "expired"],
        ),
        (
            "preparing",
            &[
                "running",
                "waiting_input",
                "waiting_approval",
                "paused",
                "succeeded",
                "failed",
                "canceled",
                "expired",
            ],
        ),
        (
            "running",
            &[
                "waiting_input",
                "waiting_approval",
                "paused",
                "succeeded",
                "failed",
                "canceled",
                "expired",
            ],
        ),
        (
            "waiting_input",
            &["running", "failed", "canceled", "expired"],
        ),
        (
            "waiting_approval",
            &["running", "failed", "canceled", "expired"],
        ),
        ("paused", &["running", "canceled", "expired"]),
        (
            "retrying",
            &[
                "queued",
                "preparing",
                "running",
                "failed",
                "canceled",
                "expired",
            ],
        ),
        ("succeeded", &[]),
        ("failed", &["retrying"]),
        ("canceled", &["retrying"]),
        ("expired", &["retrying"]),
    ];

    #[test]
    fn run_and_task_tables_match_soit_in_full() {
        let expected: Vec<(&str, Vec<&str>)> =
            RUN_TABLE.iter().map(|(f, t)| (*f, t.to_vec())).collect();
        assert_eq!(table(Resource::Run), expected);
        assert_eq!(table(Resource::Task), expected);
    }

    #[test]
    fn step_table_adds_skipped_from_queued_and_preparing_only() {
        let mut expected: Vec<(&str, Vec<&str>)> =
            RUN_TABLE.iter().map(|(f, t)| (*f, t.to_vec())).collect();
        expected[0].1.push("skipped");
        expected[1].1.push("skipped");
        expected.push(("skipped", vec![]));
        assert_eq!(table(Resource::Step), expected);
        assert!(!Resource::Step.allows(Running, Skipped));
    }

    #[test]
    fn every_pair_is_checked_against_the_table() {
        for resource in Resource::ALL {
            let mut allowed = 0;
            for from in Status::ALL.into_iter().filter(|s| resource.has(*s)) {
                for to in Status::ALL.into_iter().filter(|s| resource.has(*s)) {
                    let ok = resource.check(from, to).is_ok();
                    assert_eq!(
                        ok,
                        resource.targets(from).contains(&to),
                        "{resource:?} {from:?}->{to:?}"
                    );
                    allowed += ok as usize;
                }
            }
            assert_eq!(allowed, resource.transitions().count());
        }
    }

    #[test]
    fn terminal_statuses_reach_only_retrying_or_nothing() {
        for s in Status::ALL.into_iter().filter(|s| s.is_terminal()) {
            let t = Resource::Step.targets(s);
            assert!(t.is_empty() || t == [Retrying], "{s:?}");
        }
        assert!(Resource::Run.targets(Succeeded).is_empty());
    }

    #[test]
    fn parse_refuses_unknown_and_skipped_outside_steps() {
        assert_eq!(Status::parse(Resource::Run, "running").unwrap(), Running);
        let e = Status::parse(Resource::Run, "skipped").unwrap_err();
        assert_eq!(
            (e.class, e.code),
            (Class::InvalidParameter, "STATUS_UNKNOWN")
        );
        assert_eq!(Status::parse(Resource::Step, "skipped").unwrap(), Skipped);
        assert!(Status::parse(Resource::Run, "RUNNING").is_err());
        assert!(Status::parse(Resource::Task, "done").is_err());
        assert!(Status::parse(Resource::Run, "").is_err());
    }

    #[test]
    fn invalid_transition_error_names_both_ends() {
        let e = Resource::Run.check(Succeeded, Failed).unwrap_err();
        assert_eq!(e.code, "TRANSITION_INVALID");
        assert_eq!(e.class, Class::WrongState);
        assert_eq!(e.detail["from"], "succeeded");
        assert_eq!(e.detail["to"], "failed");
    }

    #[test]
    fn same_status_is_idempotent_even_with_a_stale_expectation() {
        let r = check_transition(
            Resource::Run,
            "r",
            Status::Succeeded,
            Some(Status::Running),
            Status::Succeeded,
        );
        assert_eq!(r.unwrap(), None);
    }

    #[test]
    fn stale_expectation_is_a_conflict() {
        let e = check_transition(
            Resource::Run,
            "r",
            Status::Succeeded,
            Some(Status::Running),
            Status::Failed,
        )
        .unwrap_err();
        assert_eq!((e.class, e.code), (Class::Conflict, "TRANSITION_CONFLICT"));
        assert_eq!(e.detail["actual"], "succeeded");
    }

    #[test]
    fn without_expectation_the_current_status_is_checked() {
        let e = check_transition(Resource::Run, "r", Status::Succeeded, None, Status::Failed)
            .unwrap_err();
        assert_eq!(e.code, "TRANSITION_INVALID");
        assert_eq!(
            check_transition(Resource::Run, "r", Status::Queued, None, Status::Running).unwrap(),
            Some(Status::Queued)
        );
    }
}
