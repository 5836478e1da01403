//! The write-statement rule of CONTRIBUTING.md: every INSERT, UPDATE and DELETE the extension
//! sends is in a form a distributed engine (Citus, every table distributed by `tenant_id`)
//! accepts. The statements are found where the extension keeps them (`sql/queries/*.sql`, the
//! string literals of `src/`, and the statements the core builds) and parsed with a real SQL
//! parser (PostgreSQL dialect). A write statement
//! - calls no VOLATILE function in an UPDATE or DELETE, nor in an INSERT ... SELECT (the time is a
//!   parameter: `db::clock()`, `db::now()`), and no STABLE function of a column in an UPDATE;
//! - calls no function that is not IMMUTABLE inside CASE or COALESCE, in RETURNING or in
//!   ON CONFLICT DO UPDATE;
//! - has no subquery in an INSERT's VALUES (an INSERT ... SELECT instead, or a lookup first);
//! - casts nothing to a table's row type and returns no whole row;
//!
//! and every function it calls is listed, with its volatility, in `statement_forms/volatility.rs`
//! (which a `#[pg_test]` compares with the server's catalog).

#[path = "statement_forms/volatility.rs"]
mod volatility;

use std::collections::BTreeSet;
use std::fs;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use sqlparser::ast::{
    visit_expressions, visit_statements, DataType, Delete, Expr, FromTable, InTarget, Insert,
    ObjectName, OnConflictAction, OnInsert, SelectItem, SetExpr, Statement, TableFactor, Update,
    Visit,
};
use sqlparser::dialect::PostgreSqlDialect;
use sqlparser::parser::Parser;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A statement and where it comes from.
struct Source {
    place: String,
    text: String,
}

fn files(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("a source directory") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            files(&path, ext, out);
        } else if path.extension().is_some_and(|e| e == ext) {
            out.push(path);
        }
    }
    out.sort();
}

/// The string literals of Rust source `text` (escapes resolved, a `\` line continuation joined),
/// outside comments and outside the test modules (`#[cfg(any(test, feature = "pg_test"))]`
/// and what follows: tests write rows directly to stage a case).
fn literals(text: &str) -> Vec<String> {
    let text = text
        .split("#[cfg(any(test, feature = \"pg_test\"))]")
        .next()
        .unwrap_or_default();
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '/' if chars.get(i + 1) == Some(&'/') => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '/' if chars.get(i + 1) == Some(&'*') => {
                i += 2;
                while i + 1 < chars.len() && !(chars[i] == '*' && chars[i + 1] == '/') {
                    i += 1;
                }
                i += 2;
            }
            // A char literal ('"', '{', '\'' ...); a lifetime has no closing quote.
            '\'' => {
                if chars.get(i + 1) == Some(&'\\') {
                    i += 4;
                } else if chars.get(i + 2) == Some(&'\'') {
                    i += 3;
                } else {
                    i += 1;
                }
            }
            'r' if matches!(chars.get(i + 1), Some('"') | Some('#'))
                && (i == 0 || !(chars[i - 1].is_alphanumeric() || chars[i - 1] == '_')) =>
            {
                let mut j = i + 1;
                let mut hashes = 0;
                while chars.get(j) == Some(&'#') {
                    hashes += 1;
                    j += 1;
                }
                if chars.get(j) != Some(&'"') {
                    i += 1;
                    continue;
                }
                let start = j + 1;
                let close: String = std::iter::once('"')
                    .chain(std::iter::repeat_n('#', hashes))
                    .collect();
                let rest: String = chars[start..].iter().collect();
                let end = rest.find(&close).expect("a closed raw string");
                out.push(rest[..end].to_owned());
                i = start + rest[..end].chars().count() + close.chars().count();
            }
            '"' => {
                let mut s = String::new();
                i += 1;
                while i < chars.len() && chars[i] != '"' {
                    if chars[i] == '\\' {
                        i += 1;
                        match chars.get(i) {
                            Some('\n') => {
                                while chars.get(i + 1).is_some_and(|c| c.is_whitespace()) {
                                    i += 1;
                                }
                            }
                            Some('n') => s.push('\n'),
                            Some('t') => s.push('\t'),
                            Some(&c) => s.push(c),
                            None => {}
                        }
                    } else {
                        s.push(chars[i]);
                    }
                    i += 1;
                }
                out.push(s);
                i += 1;
            }
            _ => i += 1,
        }
    }
    out
}

/// A `format!` template made a statement: `{{`/`}}` are braces, a placeholder a representative.
fn formatted(template: &str) -> String {
    let mut out = String::new();
    let mut rest = template;
    while let Some(at) = rest.find(['{', '}']) {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        if tail.starts_with("{{") || tail.starts_with("}}") {
            out.push_str(&tail[..1]);
            rest = &tail[2..];
        } else if let Some(end) = tail.strip_prefix('{').and_then(|t| t.find('}')) {
            out.push_str(match &tail[1..1 + end] {
                "on_conflict" => "DO NOTHING",
                "condition" => "true",
                "table" => "ledger.runs",
                _ => "x",
            });
            rest = &tail[end + 2..];
        } else {
            out.push_str(&tail[..1]);
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

/// Whether `sql` starts like a statement that may write (its first word, in capitals as the
/// extension writes SQL).
fn may_write(sql: &str) -> bool {
    let first = sql
        .trim_start()
        .split(|c: char| !c.is_alphabetic())
        .next()
        .unwrap_or_default();
    let writes = ["INSERT", "UPDATE", "DELETE"];
    writes.contains(&first) || (first == "WITH" && writes.iter().any(|w| sql.contains(w)))
}

/// Every statement that may write, from where the extension keeps them.
fn sources() -> Vec<Source> {
    let root = root();
    let mut out = Vec::new();
    let mut queries = Vec::new();
    files(&root.join("sql/queries"), "sql", &mut queries);
    for path in queries {
        let text = fs::read_to_string(&path).expect("a query file");
        if may_write(&strip_sql_comments(&text)) {
            out.push(Source {
                place: path
                    .strip_prefix(&root)
                    .unwrap_or(&path)
                    .display()
                    .to_string(),
                text,
            });
        }
    }
    let mut rust = Vec::new();
    files(&root.join("src"), "rs", &mut rust);
    for path in rust {
        let place = path
            .strip_prefix(&root)
            .unwrap_or(&path)
            .display()
            .to_string();
        if place.starts_with("src/testing") {
            continue;
        }
        let text = fs::read_to_string(&path).expect("a source file");
        for literal in literals(&text) {
            if may_write(&literal) {
                out.push(Source {
                    place: place.clone(),
                    text: formatted(&literal),
                });
            }
        }
    }
    for n in 1..=8 {
        for notify in [false, true] {
            out.push(Source {
                place: format!("ledger_model::feed::insert_statement({n}, {notify})"),
                text: ledger_model::feed::insert_statement(n, notify),
            });
        }
    }
    use ledger_model::transition::{statement, RUN, STEP, TASK};
    for (name, columns) in [("RUN", &RUN), ("STEP", &STEP), ("TASK", &TASK)] {
        out.push(Source {
            place: format!("ledger_model::transition::statement(&{name})"),
            text: statement(columns),
        });
    }
    out
}

fn strip_sql_comments(text: &str) -> String {
    text.lines()
        .filter(|l| !l.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The tables of the extension (their row types are the ones a write must not cast to).
fn tables() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut sql = Vec::new();
    files(&root().join("sql"), "sql", &mut sql);
    for path in sql {
        let text = fs::read_to_string(&path).expect("an SQL file");
        for part in text.split("CREATE TABLE ledger.").skip(1) {
            let name: String = part
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            out.insert(name);
        }
    }
    out
}

fn name_of(name: &ObjectName) -> String {
    name.0
        .last()
        .map(|p| p.to_string().trim_matches('"').to_ascii_lowercase())
        .unwrap_or_default()
}

/// What is wrong with one write statement's expressions; `context` names the part.
struct Check<'a> {
    tables: &'a BTreeSet<String>,
    problems: Vec<String>,
}

/// Constructs the parser shows as functions but that PostgreSQL evaluates itself.
const CONSTRUCTS: [&str; 4] = ["coalesce", "nullif", "greatest", "least"];

fn volatility_of(name: &str) -> Option<char> {
    if CONSTRUCTS.contains(&name) {
        return Some('i');
    }
    volatility::VOLATILITY
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| *v)
}

/// The functions `node` calls, each with whether its call refers to a column.
fn functions_in<V: Visit>(node: &V) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    let _ = visit_expressions(node, |e| {
        if let Expr::Function(f) = e {
            out.push((name_of(&f.name), has_column(e)));
        }
        ControlFlow::<()>::Continue(())
    });
    out
}

fn has_column(expr: &Expr) -> bool {
    let mut found = false;
    let _ = visit_expressions(expr, |e| {
        if matches!(e, Expr::Identifier(_) | Expr::CompoundIdentifier(_)) {
            found = true;
        }
        ControlFlow::<()>::Continue(())
    });
    found
}

impl Check<'_> {
    fn problem(&mut self, what: String) {
        self.problems.push(what);
    }

    /// Every expression: listed functions, CASE/COALESCE, casts to row types.
    fn everywhere<V: Visit>(&mut self, node: &V) {
        let _ = visit_expressions(node, |e| {
            match e {
                Expr::Function(f) => {
                    let name = name_of(&f.name);
                    if volatility_of(&name).is_none() {
                        self.problem(format!(
                            "calls {name}(), which statement_forms/volatility.rs does not list"
                        ));
                    }
                    if name == "coalesce" {
                        self.only_immutable(e, "inside COALESCE");
                    }
                }
                Expr::Case { .. } => self.only_immutable(e, "inside CASE"),
                Expr::Cast {
                    data_type: DataType::Custom(name, _),
                    ..
                } if self.tables.contains(&name_of(name)) => {
                    self.problem(format!("casts to the row type of table {name}"))
                }
                _ => {}
            }
            ControlFlow::<()>::Continue(())
        });
    }

    fn only_immutable(&mut self, expr: &Expr, context: &str) {
        for (name, _) in functions_in(expr) {
            if volatility_of(&name).is_some_and(|v| v != 'i') {
                self.problem(format!("calls {name}(), not IMMUTABLE, {context}"));
            }
        }
    }

    fn no_volatile<V: Visit>(&mut self, node: &V, context: &str) {
        for (name, _) in functions_in(node) {
            if volatility_of(&name) == Some('v') {
                self.problem(format!("calls {name}(), VOLATILE, {context}"));
            }
        }
    }

    /// An UPDATE's SET value or WHERE: no VOLATILE function, no STABLE one of a column.
    fn updated(&mut self, expr: &Expr, context: &str) {
        self.no_volatile(expr, context);
        for (name, of_column) in functions_in(expr) {
            if volatility_of(&name) == Some('s') && of_column {
                self.problem(format!("calls {name}(), STABLE, of a column {context}"));
            }
        }
    }

    fn no_subquery(&mut self, expr: &Expr, context: &str) {
        let _ = visit_expressions(expr, |e| {
            if matches!(
                e,
                Expr::Subquery(_)
                    | Expr::Exists { .. }
                    | Expr::In {
                        target: InTarget::Subquery(_),
                        ..
                    }
            ) {
                self.problem(format!("has a subquery {context}"));
            }
            ControlFlow::<()>::Continue(())
        });
    }

    /// RETURNING: IMMUTABLE functions only, and no whole row (`RETURNING t`, `t.*`, `*`).
    fn returning(&mut self, items: &[SelectItem], row_names: &[String]) {
        for item in items {
            match item {
                SelectItem::UnnamedExpr(e)
                | SelectItem::ExprWithAlias { expr: e, .. }
                | SelectItem::ExprWithAliases { expr: e, .. } => {
                    if let Expr::Identifier(id) = e {
                        if row_names.contains(&id.value.to_ascii_lowercase()) {
                            self.problem(format!("returns the whole row {id}"));
                        }
                    }
                    self.everywhere(e);
                    self.only_immutable(e, "in RETURNING");
                }
                SelectItem::Wildcard(_) | SelectItem::QualifiedWildcard(..) => {
                    self.problem("returns a whole row (*)".to_owned())
                }
            }
        }
    }
}

/// The names a write's target row goes by: the table and its alias.
fn row_names(relation: &TableFactor) -> Vec<String> {
    match relation {
        TableFactor::Table { name, alias, .. } => {
            let mut out = vec![name_of(name)];
            if let Some(a) = alias {
                out.push(a.name.value.to_ascii_lowercase());
            }
            out
        }
        _ => Vec::new(),
    }
}

fn check_write(statement: &Statement, check: &mut Check) {
    match statement {
        Statement::Insert(Insert {
            table,
            table_alias,
            source,
            on,
            returning,
            ..
        }) => {
            let mut names = vec![table
                .to_string()
                .rsplit('.')
                .next()
                .unwrap_or_default()
                .to_owned()];
            if let Some(a) = table_alias {
                names.push(a.alias.value.to_ascii_lowercase());
            }
            if let Some(source) = source {
                check.everywhere(source.as_ref());
                match source.body.as_ref() {
                    SetExpr::Values(values) => {
                        for e in values.rows.iter().flat_map(|r| r.content.iter()) {
                            check.no_subquery(e, "in an INSERT's VALUES");
                        }
                    }
                    _ => check.no_volatile(source.as_ref(), "in an INSERT ... SELECT"),
                }
            }
            if let Some(OnInsert::OnConflict(c)) = on {
                if let OnConflictAction::DoUpdate(u) = &c.action {
                    for a in &u.assignments {
                        check.everywhere(&a.value);
                        check.only_immutable(&a.value, "in ON CONFLICT DO UPDATE");
                    }
                    if let Some(w) = &u.selection {
                        check.only_immutable(w, "in ON CONFLICT DO UPDATE's WHERE");
                    }
                }
            }
            if let Some(r) = returning {
                check.returning(r, &names);
            }
        }
        Statement::Update(Update {
            table,
            assignments,
            selection,
            returning,
            ..
        }) => {
            for a in assignments {
                check.everywhere(&a.value);
                check.updated(&a.value, "in an UPDATE's SET");
            }
            if let Some(w) = selection {
                check.everywhere(w);
                check.updated(w, "in an UPDATE's WHERE");
            }
            if let Some(r) = returning {
                check.returning(r, &row_names(&table.relation));
            }
        }
        Statement::Delete(Delete {
            from,
            selection,
            returning,
            ..
        }) => {
            if let Some(w) = selection {
                check.everywhere(w);
                check.no_volatile(w, "in a DELETE's WHERE");
            }
            let tables = match from {
                FromTable::WithFromKeyword(t) | FromTable::WithoutKeyword(t) => t,
            };
            if let Some(r) = returning {
                let names: Vec<String> =
                    tables.iter().flat_map(|t| row_names(&t.relation)).collect();
                check.returning(r, &names);
            }
        }
        _ => {}
    }
}

/// The problems of one source: its writes (top level or in a WITH) checked one by one; a
/// statement that only reads (`SELECT ... FOR UPDATE`) has none.
fn problems(source: &Source, tables: &BTreeSet<String>) -> Vec<String> {
    let parsed = match Parser::parse_sql(&PostgreSqlDialect {}, &source.text) {
        Ok(p) => p,
        Err(e) => return vec![format!("does not parse ({e}): keep it parseable")],
    };
    let mut check = Check {
        tables,
        problems: Vec::new(),
    };
    let _ = visit_statements(&parsed, |s| {
        check_write(s, &mut check);
        ControlFlow::<()>::Continue(())
    });
    check.problems
}

#[test]
fn every_write_statement_is_in_a_distributable_form() {
    let tables = tables();
    assert!(
        tables.contains("tasks") && tables.contains("runs"),
        "{tables:?}"
    );
    let sources = sources();
    let from_src = sources
        .iter()
        .filter(|s| s.place.starts_with("src/"))
        .count();
    let from_files = sources
        .iter()
        .filter(|s| s.place.starts_with("sql/"))
        .count();
    assert!(
        from_src >= 30 && from_files >= 20,
        "too few write statements found ({from_src} in src/, {from_files} in sql/queries/): is the extraction broken?"
    );
    let mut report = Vec::new();
    for source in &sources {
        for p in problems(source, &tables) {
            report.push(format!("{}: {p}\n    {}", source.place, source.text.trim()));
        }
    }
    assert!(report.is_empty(), "{}", report.join("\n"));
}

#[test]
fn scope_checks_name_the_role_without_reading_pg_roles() {
    let schema = fs::read_to_string(root().join("sql/schema.sql")).expect("schema.sql");
    let granted = schema
        .split("CREATE FUNCTION ledger_dispatch.scope_granted")
        .nth(1)
        .and_then(|f| f.split("$$").nth(1))
        .expect("scope_granted's body");
    assert!(!granted.contains("pg_roles") && granted.contains("to_regrole"));
    let scope = fs::read_to_string(root().join("src/scope.rs")).expect("scope.rs");
    assert!(literals(&scope).iter().all(|l| !l.contains("pg_roles")));
}

/// Each form the rule refuses is found (the checker itself can fail).
#[test]
fn each_refused_form_is_found() {
    let tables = tables();
    let refused = [
        ("UPDATE ledger.runs SET ended_at = clock_timestamp() WHERE id = $1", "VOLATILE"),
        ("DELETE FROM ledger.outbox WHERE available_at < clock_timestamp()", "VOLATILE"),
        ("UPDATE ledger.runs SET ended_at = CASE WHEN $2 THEN now() END WHERE id = $1", "CASE"),
        ("UPDATE ledger.runs SET started_at = coalesce(started_at, now()) WHERE id = $1", "COALESCE"),
        ("INSERT INTO ledger.run_steps (id, step_no) VALUES ($1, (SELECT max(step_no) FROM ledger.run_steps))", "subquery"),
        ("INSERT INTO ledger.tasks (id) SELECT $1 WHERE random() > 0", "INSERT ... SELECT"),
        ("WITH t AS (UPDATE ledger.tasks SET status = $2 WHERE id = $1 RETURNING *) SELECT (t.*)::ledger.tasks FROM t", "whole row"),
        ("INSERT INTO ledger.tasks AS t (id) VALUES ($1) RETURNING t", "whole row"),
        ("UPDATE ledger.tasks SET output = ROW(1)::ledger.tasks WHERE id = $1", "row type"),
        ("INSERT INTO ledger.task_events (id) VALUES ($1) RETURNING (task_events.*)::ledger.task_events", "row type"),
        ("UPDATE ledger.outbox SET error_message = format('%s', attempt_count) WHERE id = $1", "STABLE"),
        ("UPDATE ledger.runs SET id = no_such_function() WHERE id = $1", "does not list"),
        ("INSERT INTO ledger.runs (id) VALUES ($1) RETURNING now()", "RETURNING"),
    ];
    for (sql, expected) in refused {
        let found = problems(
            &Source {
                place: "example".to_owned(),
                text: sql.to_owned(),
            },
            &tables,
        );
        assert!(
            found.iter().any(|p| p.contains(expected)),
            "{sql}: expected a problem with {expected:?}, found {found:?}"
        );
    }
    let accepted =
        "UPDATE ledger.runs SET ended_at = CASE WHEN $2 THEN $3 END, updated_at = now() \
                    WHERE tenant_id = $4 AND id = $1 RETURNING id";
    let none = problems(
        &Source {
            place: "example".to_owned(),
            text: accepted.to_owned(),
        },
        &tables,
    );
    assert!(none.is_empty(), "{none:?}");
}
