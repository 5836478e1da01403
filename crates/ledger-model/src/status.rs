//! The status vocabularies, each declared once as data: the statuses of runs, steps and tasks
//! with their transition table, of tool calls and of approvals.

use crate::error::{Code, LedgerError, Result};

/// Declares a vocabulary: each value's wire name, `terminal` or `live`, and optionally (`to
/// [...]`, on every value) the values it may move to. Generates the enum, `ALL` (declaration
/// order), `as_str`, `from_name`, `is_terminal` and, with transitions, `moves_to`.
macro_rules! vocabulary {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $($(#[$vmeta:meta])* $variant:ident = $wire:literal, $end:ident, to [$($to:ident),*];)+
        }
    ) => {
        vocabulary! { $(#[$meta])* pub enum $name { $($(#[$vmeta])* $variant = $wire, $end;)+ } }

        impl $name {
            /// The values this one may move to, in table order.
            pub fn moves_to(self) -> &'static [$name] {
                match self {
                    $($name::$variant => &[$($name::$to),*],)+
                }
            }
        }
    };
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $($(#[$vmeta:meta])* $variant:ident = $wire:literal, $end:ident;)+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: [$name; [$(stringify!($variant)),+].len()] = [$($name::$variant),+];

            /// The wire name (the database's and the API's).
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $wire,)+
                }
            }

            /// The value of a wire name; names are exact (case included).
            pub fn from_name(name: &str) -> Option<$name> {
                $name::ALL.into_iter().find(|v| v.as_str() == name)
            }

            /// Whether the value ends the thing's life (a retry may still revive a run).
            pub fn is_terminal(self) -> bool {
                match self {
                    $($name::$variant => vocabulary!(@terminal $end),)+
                }
            }
        }
    };
    (@terminal terminal) => {
        true
    };
    (@terminal live) => {
        false
    };
}

vocabulary! {
    /// The statuses of runs, steps and tasks: the eleven execution statuses, then `skipped`.
    /// The transitions are those of every resource; only steps have `skipped`, so runs and tasks
    /// share one table and steps add `skipped` from `queued` and `preparing`.
    pub enum Status {
        Queued = "queued", live, to [Preparing, Running, Failed, Canceled, Expired, Skipped];
        Preparing = "preparing", live, to [
            Running, WaitingInput, WaitingApproval, Paused, Succeeded, Failed, Canceled, Expired,
            Skipped
        ];
        Running = "running", live, to [
            WaitingInput, WaitingApproval, Paused, Succeeded, Failed, Canceled, Expired
        ];
        WaitingInput = "waiting_input", live, to [Running, Failed, Canceled, Expired];
        WaitingApproval = "waiting_approval", live, to [Running, Failed, Canceled, Expired];
        Paused = "paused", live, to [Running, Canceled, Expired];
        Retrying = "retrying", live, to [Queued, Preparing, Running, Failed, Canceled, Expired];
        Succeeded = "succeeded", terminal, to [];
        Failed = "failed", terminal, to [Retrying];
        Canceled = "canceled", terminal, to [Retrying];
        Expired = "expired", terminal, to [Retrying];
        /// Steps only.
        Skipped = "skipped", terminal, to [];
    }
}

vocabulary! {
    /// The statuses of a tool-call record; a terminal call (`succeeded`, `failed`, `rejected`)
    /// no longer keeps its run from being purged.
    pub enum CallStatus {
        WaitingApproval = "waiting_approval", live;
        Claimed = "claimed", live;
        Running = "running", live;
        Succeeded = "succeeded", terminal;
        Failed = "failed", terminal;
        /// The request may have left and no answer came back: a person resolves it.
        InDoubt = "in_doubt", live;
        Rejected = "rejected", terminal;
    }
}

vocabulary! {
    /// The statuses of an approval request: pending until decided.
    pub enum ApprovalStatus {
        Pending = "pending", live;
        Approved = "approved", terminal;
        Rejected = "rejected", terminal;
        Expired = "expired", terminal;
        Canceled = "canceled", terminal;
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resource {
    Run,
    Step,
    Task,
}

use Status::*;

impl Status {
    /// Statuses that mean the work has begun (first entry sets `started_at`).
    pub fn is_started(self) -> bool {
        matches!(self, Preparing | Running)
    }

    /// Parses a status of `resource`; unknown names (and `skipped` outside steps) are refused.
    pub fn parse(resource: Resource, name: &str) -> Result<Status> {
        Status::from_name(name)
            .filter(|s| resource.has(*s))
            .ok_or_else(|| {
                // Echo at most 64 characters of a bad value back (it may be megabytes).
                let shown = crate::text::truncate_chars(name, 64);
                LedgerError::new(
                    Code::StatusUnknown,
                    format!("unknown {} status: {shown:?}", resource.as_str()),
                )
                .with("resource", resource.as_str())
                .with("status", shown)
            })
    }
}

impl CallStatus {
    /// A status read back from the ledger's own row; anything else is a bug.
    pub fn parse(s: &str) -> Result<CallStatus> {
        CallStatus::from_name(s)
            .ok_or_else(|| LedgerError::internal(format!("unknown tool call status {s:?}")))
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

    /// The statuses `from` may move to: the table's, restricted to the resource's statuses.
    pub fn targets(self, from: Status) -> Vec<Status> {
        from.moves_to()
            .iter()
            .copied()
            .filter(|to| self.has(*to))
            .collect()
    }

    pub fn allows(self, from: Status, to: Status) -> bool {
        self.has(from) && self.has(to) && from.moves_to().contains(&to)
    }

    /// Refuses a move the table does not allow (55000 `TRANSITION_INVALID`).
    pub fn check(self, from: Status, to: Status) -> Result<()> {
        if self.allows(from, to) {
            return Ok(());
        }
        Err(LedgerError::new(
            Code::TransitionInvalid,
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
            .flat_map(move |from| self.targets(from).into_iter().map(move |to| (from, to)))
    }
}

/// 40001 `TRANSITION_CONFLICT`: the row was no longer at `expected`.
pub fn conflict(resource: Resource, id: &str, expected: Status, to: Status) -> LedgerError {
    LedgerError::new(
        Code::TransitionConflict,
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
    use crate::error::Class;

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

    /// The run table, written out independently of the declaration above.
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
            (e.class(), e.code),
            (Class::InvalidParameter, Code::StatusUnknown)
        );
        assert_eq!(Status::parse(Resource::Step, "skipped").unwrap(), Skipped);
        assert!(Status::parse(Resource::Run, "RUNNING").is_err());
        assert!(Status::parse(Resource::Task, "done").is_err());
        assert!(Status::parse(Resource::Run, "").is_err());
    }

    #[test]
    fn invalid_transition_error_names_both_ends() {
        let e = Resource::Run.check(Succeeded, Failed).unwrap_err();
        assert_eq!(e.code, Code::TransitionInvalid);
        assert_eq!(e.class(), Class::WrongState);
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
        assert_eq!(
            (e.class(), e.code),
            (Class::Conflict, Code::TransitionConflict)
        );
        assert_eq!(e.detail["actual"], "succeeded");
    }

    #[test]
    fn without_expectation_the_current_status_is_checked() {
        let e = check_transition(Resource::Run, "r", Status::Succeeded, None, Status::Failed)
            .unwrap_err();
        assert_eq!(e.code, Code::TransitionInvalid);
        assert_eq!(
            check_transition(Resource::Run, "r", Status::Queued, None, Status::Running).unwrap(),
            Some(Status::Queued)
        );
    }

    /// The quoted names of the first `status IN (...)` or `status NOT IN (...)` list after
    /// `after` in `sql`.
    fn sql_list(sql: &str, after: &str, list: &str) -> Vec<String> {
        let rest = &sql[sql.find(after).expect(after)..];
        let rest = &rest[rest.find(list).expect(list) + list.len()..];
        rest[..rest.find(')').expect("a closed list")]
            .split(',')
            .map(|n| n.trim().trim_matches('\'').to_owned())
            .collect()
    }

    fn names<T: Copy>(
        values: impl IntoIterator<Item = T>,
        as_str: fn(T) -> &'static str,
    ) -> Vec<String> {
        values.into_iter().map(|v| as_str(v).to_owned()).collect()
    }

    /// The CHECK constraints that still list statuses, and the queries that name terminal
    /// statuses, say what the vocabularies declare. (Runs', steps', tasks' and tool calls' CHECKs
    /// call ledger.is_status, which reads these vocabularies.)
    #[test]
    fn the_sql_names_the_declared_statuses() {
        let schema = include_str!("../../../sql/schema.sql");
        let purge = include_str!("../../../sql/queries/purgeable_runs.sql");
        let status_in = "status IN (";
        assert_eq!(
            sql_list(schema, "TABLE ledger.approval_requests (", status_in),
            names(ApprovalStatus::ALL, ApprovalStatus::as_str)
        );
        let run_terminal = Status::ALL
            .into_iter()
            .filter(|s| s.is_terminal() && Resource::Run.has(*s));
        assert_eq!(
            sql_list(schema, "INDEX runs_live_idx", "status NOT IN ("),
            names(run_terminal, Status::as_str)
        );
        assert_eq!(
            sql_list(purge, "run_step_tool_calls", "status NOT IN ("),
            names(
                CallStatus::ALL.into_iter().filter(|s| s.is_terminal()),
                CallStatus::as_str
            )
        );
        let decided = ApprovalStatus::ALL.into_iter().filter(|s| s.is_terminal());
        assert_eq!(
            names(decided, ApprovalStatus::as_str),
            ["approved", "rejected", "expired", "canceled"]
        );
    }

    #[test]
    fn every_wire_name_reads_back_as_its_value() {
        for s in Status::ALL {
            assert_eq!(Status::from_name(s.as_str()), Some(s));
        }
        for s in ApprovalStatus::ALL {
            assert_eq!(ApprovalStatus::from_name(s.as_str()), Some(s));
        }
        assert_eq!(ApprovalStatus::from_name("Pending"), None);
        assert_eq!(CallStatus::from_name(""), None);
    }
}
