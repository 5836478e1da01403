//! Cost entries of a run.

use crate::budgets;
use crate::db;
use crate::error::{Code, LedgerError, Result, SqlError};
use crate::feed;
use crate::jsonb::Jsonb;
use crate::outbox;
use crate::redaction::redacted_object;
use crate::rows;
use crate::scope::{self, Scope};
use ledger_model::args::{optional_label, required_id, required_label};
use ledger_model::events::{CostRecorded, Event};
use ledger_model::evidence::costs;
use ledger_model::ids;
use pgrx::prelude::*;
use pgrx::AnyNumeric;

fn row(
    scope: &Scope,
    id: &str,
) -> Result<pgrx::composite_type!('static, "ledger.run_cost_entries")> {
    rows::scoped_row(
        scope,
        "ledger.run_cost_entries",
        id,
        Code::CostNotFound,
        "cost entry",
    )
}

/// Declares the `record_cost` overloads, which differ only in the type of `amount`: each takes
/// the same arguments and hands `record` its amount as a decimal (the expression after `=>`).
/// pgrx needs every overload spelled as a `#[pg_extern]` fn; the types are `tt`s so that its
/// attribute sees plain tokens (`default!(...)` included).
macro_rules! record_cost_overloads {
    ($(
        $(#[doc = $doc:literal])*
        fn $name:ident($amount:ident: $($amount_type:tt)+) => $decimal:expr;
    )+) => {$(
        $(#[doc = $doc])*
        #[allow(clippy::too_many_arguments)]
        #[pg_extern(
            name = "record_cost",
            volatile,
            parallel_unsafe,
            security_definer,
            requires = ["ledger_schema"]
        )]
        #[search_path(pg_catalog, ledger, pg_temp)]
        fn $name(
            run_id: Option<&str>,
            billing_basis: Option<&str>,
            billed_quantity: Option<AnyNumeric>,
            $amount: $($amount_type)+,
            currency: default!(Option<&str>, "NULL"),
            step_id: default!(Option<&str>, "NULL"),
            usage: default!(Option<Jsonb>, "'{}'"),
            pricing_snapshot: default!(Option<Jsonb>, "'{}'"),
            provider: default!(Option<&str>, "NULL"),
            model_ref: default!(Option<&str>, "NULL"),
            tool_ref: default!(Option<&str>, "NULL"),
            source_port: default!(Option<&str>, "NULL"),
            operation: default!(Option<&str>, "NULL"),
            source_ref: default!(Option<&str>, "NULL"),
        ) -> std::result::Result<pgrx::composite_type!('static, "ledger.run_cost_entries"), SqlError>
        {
            Ok(record(
                run_id,
                billing_basis,
                billed_quantity,
                $decimal,
                currency,
                step_id,
                usage,
                pricing_snapshot,
                [provider, model_ref, tool_ref, source_port, operation],
                source_ref,
            )?)
        }
    )+};
}

record_cost_overloads! {
    /// Records a cost entry. `source_ref` is idempotent per scope: the same reference again returns
    /// the entry already recorded. Writes `cost.recorded` to the run's feed and the outbox.
    fn record_cost(amount: default!(Option<AnyNumeric>, "NULL")) => amount;

    /// `record_cost` with a double precision amount, which is what a client's float binds as (a
    /// Python float through psycopg): without it PostgreSQL finds no function, since double precision
    /// does not convert to numeric implicitly. The amount is taken as its shortest decimal text, the
    /// one that reads back as the same double (0.1 is 0.1, not 0.1000000000000000055511151231257827).
    fn record_cost_float_amount(amount: Option<f64>) => float_decimal(amount)?;

    /// `record_cost` with a bigint amount, so that an integer stays exact: an integer literal past
    /// int4 (or a client's large integer) is a bigint, which PostgreSQL would otherwise convert to
    /// double precision, the preferred numeric type, and round past 2^53.
    fn record_cost_integer_amount(amount: Option<i64>) => amount.map(AnyNumeric::from);
}

/// A double precision amount as the decimal of its shortest text.
fn float_decimal(amount: Option<f64>) -> Result<Option<AnyNumeric>> {
    amount
        .map(|a| {
            let text = costs::float_text("amount", a)?;
            text.parse::<AnyNumeric>()
                .map_err(|e| LedgerError::internal(format!("decimal text {text}: {e}")))
        })
        .transpose()
}

/// What every `record_cost` does, once its amount is a decimal. `labels`: provider, model_ref,
/// tool_ref, source_port, operation.
#[allow(clippy::too_many_arguments)]
fn record(
    run_id: Option<&str>,
    billing_basis: Option<&str>,
    billed_quantity: Option<AnyNumeric>,
    amount: Option<AnyNumeric>,
    currency: Option<&str>,
    step_id: Option<&str>,
    usage: Option<Jsonb>,
    pricing_snapshot: Option<Jsonb>,
    labels: [Option<&str>; 5],
    source_ref: Option<&str>,
) -> Result<pgrx::composite_type!('static, "ledger.run_cost_entries")> {
    let [provider, model_ref, tool_ref, source_port, operation] = labels;
    let scope = scope::current()?;
    let run_id = required_id("run_id", run_id)?;
    let billing_basis = required_label("billing_basis", billing_basis)?;
    for (argument, label) in [
        ("provider", provider),
        ("model_ref", model_ref),
        ("tool_ref", tool_ref),
        ("source_port", source_port),
        ("operation", operation),
    ] {
        optional_label(argument, label)?;
    }
    let quantity = billed_quantity.ok_or_else(|| LedgerError::required("billed_quantity"))?;
    costs::check_non_negative(
        "billed_quantity",
        Code::QuantityInvalid,
        &quantity.to_string(),
    )?;
    if let Some(a) = &amount {
        costs::check_non_negative("amount", Code::AmountInvalid, &a.to_string())?;
    }
    let currency = currency.map(costs::currency).transpose()?;
    if amount.is_some() && currency.is_none() {
        return Err(LedgerError::new(
            Code::CurrencyRequired,
            "an amount needs a currency",
        ));
    }
    let usage = costs::normalize_usage(&redacted_object("usage", usage)?)?;
    let pricing = redacted_object("pricing_snapshot", pricing_snapshot)?;
    if let Some(r) = source_ref {
        ids::validate_key("source_ref", r)?;
    }
    let run = rows::lock_owner(&scope, run_id, step_id)?;

    let id = ids::new_id("cost");
    let inserted = db::write_one(
        include_str!("../../sql/queries/insert_cost_entry.sql"),
        &scope.args([
            id.as_str().into(),
            run_id.into(),
            step_id.into(),
            billing_basis.into(),
            quantity.into(),
            amount.clone().into(),
            currency.clone().into(),
            Jsonb::from(&usage).into(),
            Jsonb::from(&pricing).into(),
            provider.into(),
            model_ref.into(),
            tool_ref.into(),
            source_port.into(),
            operation.into(),
            source_ref.into(),
        ]),
        |r| db::opt::<String>(r, 1),
    )?;
    let Some(amount_text) = inserted else {
        // Only source_ref can conflict (the id is new): that entry is the answer.
        let existing = db::select_one(
            "SELECT id FROM ledger.run_cost_entries \
              WHERE tenant_id = $1 AND workspace_id = $2 AND source_ref = $3",
            &scope.args([source_ref.into()]),
            |r| db::req::<String>(r, 1),
        )?
        .ok_or_else(|| LedgerError::internal("cost insert conflicted but no entry was found"))?;
        return row(&scope, &existing);
    };
    let recorded = Event::CostRecorded(CostRecorded {
        cost_id: &id,
        run_id,
        step_id,
        billing_basis,
        amount: amount_text.as_deref(),
        currency: currency.as_deref(),
        source_ref,
    });
    feed::append(&scope, run.held(), step_id, &recorded)?;
    outbox::enqueue(&scope, &recorded, Some(run_id), None, &format!("cost:{id}"))?;
    // Money already spent is counted, never refused: it may push a budget over.
    budgets::spend(
        &scope,
        run_id,
        &budgets::cost_amounts(amount.as_ref(), currency.as_deref(), &usage),
    )?;
    row(&scope, &id)
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one, set_scope};
    use pgrx::prelude::*;

    #[pg_test]
    fn costs_are_exact_idempotent_and_announced() {
        set_scope("t-costs", "w");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r')").unwrap();
        let a = one::<String>("SELECT id FROM ledger.record_cost('r', 'tokens', 3, 0.1, 'usd', source_ref => 'inv-1')");
        let b = one::<String>("SELECT id FROM ledger.record_cost('r', 'tokens', 3, 0.1, 'usd', source_ref => 'inv-1')");
        assert_eq!(a, b);
        Spi::run("SELECT ledger.record_cost('r', 'tokens', 3, 0.2, 'USD')").unwrap();
        // 0.1 + 0.2 is 0.3 in numeric (it is not in float).
        assert_eq!(
            one::<String>("SELECT cost->>'USD' FROM ledger.run_overview"),
            "0.3"
        );
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.run_cost_entries"),
            2
        );
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.outbox WHERE event_type = 'cost.recorded'"),
            2
        );
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.run_events WHERE event_type = 'cost.recorded'"),
            2
        );
        assert_eq!(one::<String>("SELECT payload->>'amount' FROM ledger.outbox WHERE event_type = 'cost.recorded' ORDER BY id LIMIT 1"), "0.1");
    }

    /// A client's float (double precision) is accepted as an amount and stored as its
    /// shortest decimal text; integers and decimals keep their exact value; the model APIs'
    /// usage objects are stored under the ledger's keys.
    #[pg_test]
    fn float_amounts_and_api_usage_objects_are_taken_as_given() {
        set_scope("t-costs-float", "w");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r')").unwrap();
        for (amount, stored) in [
            ("0.1::float8", "0.1"),
            ("(0.1::float8 + 0.2::float8)", "0.30000000000000004"),
            ("2", "2"),
            ("0.1", "0.1"),
            ("1.10::numeric", "1.10"),
            ("12345678901234567890.123", "12345678901234567890.123"),
            ("1e-7::float8", "0.0000001"),
            // An integer literal past int4 is a bigint: exact, not rounded through a double.
            ("9007199254740993", "9007199254740993"),
            ("9223372036854775807", "9223372036854775807"),
            ("2147483647", "2147483647"),
        ] {
            assert_eq!(
                one::<String>(&format!(
                    "SELECT amount::text FROM ledger.record_cost('r', 'tokens', 1, {amount}, 'USD')"
                )),
                stored,
                "{amount}"
            );
        }
        assert!(one::<bool>(
            "SELECT amount IS NULL FROM ledger.record_cost('r', 'tokens', 1, NULL::float8)"
        ));
        for bad in [
            "'NaN'::float8",
            "'Infinity'::float8",
            "-0.5::float8",
            "(-9007199254740993)",
        ] {
            assert_error(
                &format!("SELECT ledger.record_cost('r', 'tokens', 1, {bad}, 'USD')"),
                "22023",
                "AMOUNT_INVALID",
            );
        }
        assert_eq!(
            one::<String>(
                "SELECT usage::text FROM ledger.record_cost('r', 'tokens', 1, 0.5::float8, 'USD', usage => \
                 '{\"input_tokens\": 1200, \"output_tokens\": 300, \"input_tokens_details\": {\"cached_tokens\": 1024}, \
                   \"output_tokens_details\": {\"reasoning_tokens\": 192}, \"total_tokens\": 1500}')"
            ),
            r#"{"total_tokens": 1500, "prompt_tokens": 1200, "reasoning_tokens": 192, "cache_read_tokens": 1024, "completion_tokens": 300}"#
        );
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.run_cost_entries"),
            12
        );
    }

    #[pg_test]
    fn bad_costs_are_refused_and_write_nothing() {
        set_scope("t-costs-bad", "w");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r')").unwrap();
        for (sql, code) in [
            (
                "SELECT ledger.record_cost('r', 'tokens', -1)",
                "QUANTITY_INVALID",
            ),
            (
                "SELECT ledger.record_cost('r', 'tokens', 'NaN')",
                "QUANTITY_INVALID",
            ),
            (
                "SELECT ledger.record_cost('r', 'tokens', 1, -0.01, 'USD')",
                "AMOUNT_INVALID",
            ),
            (
                "SELECT ledger.record_cost('r', 'tokens', 1, 1)",
                "CURRENCY_REQUIRED",
            ),
            (
                "SELECT ledger.record_cost('r', 'tokens', 1, 1, 'US DOLLARS')",
                "CURRENCY_INVALID",
            ),
            (
                "SELECT ledger.record_cost('r', 'tokens', 1, usage => '{\"tokens\": 1}')",
                "USAGE_KEY_UNKNOWN",
            ),
            (
                "SELECT ledger.record_cost('r', 'tokens', 1, usage => '{\"prompt_tokens\": -5}')",
                "USAGE_INVALID",
            ),
            (
                "SELECT ledger.record_cost('r', 'tokens', 1, usage => '[1]')",
                "ARGUMENT_NOT_OBJECT",
            ),
            (
                "SELECT ledger.record_cost('r', 'tokens', 1, pricing_snapshot => '1')",
                "ARGUMENT_NOT_OBJECT",
            ),
            (
                "SELECT ledger.record_cost('r', NULL, 1)",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.record_cost('r', 'tokens', NULL)",
                "ARGUMENT_REQUIRED",
            ),
        ] {
            assert_error(sql, "22023", code);
        }
        assert_error(
            "SELECT ledger.record_cost('nope', 'tokens', 1)",
            "P0002",
            "RUN_NOT_FOUND",
        );
        assert_error(
            "SELECT ledger.record_cost('r', 'tokens', 1, step_id => 'nope')",
            "P0002",
            "STEP_NOT_FOUND",
        );
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.run_cost_entries"),
            0
        );
    }
}
