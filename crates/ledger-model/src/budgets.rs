//! Budgets: what the runs of a tenant, of a workspace or one run may spend in a window. The
//! vocabulary (levels, periods, units) and the arithmetic that needs no database.

use crate::error::{Code, LedgerError, Result};
use crate::evidence::costs;
use serde_json::Value;

/// Whose spending a budget limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// Every workspace of the tenant.
    Tenant,
    /// The scope's workspace.
    Workspace,
    /// One run.
    Run,
}

impl Level {
    pub fn parse(level: &str) -> Result<Level> {
        match level {
            "tenant" => Ok(Level::Tenant),
            "workspace" => Ok(Level::Workspace),
            "run" => Ok(Level::Run),
            _ => Err(LedgerError::new(
                Code::LevelUnknown,
                "level must be tenant, workspace or run",
            )
            .with("level", crate::text::truncate_chars(level, 64))),
        }
    }
}

/// The window a budget counts in: everything, or a calendar day or month in UTC.
pub fn period(period: &str) -> Result<&'static str> {
    match period {
        "total" => Ok("total"),
        "day" => Ok("day"),
        "month" => Ok("month"),
        _ => Err(
            LedgerError::new(Code::PeriodUnknown, "period must be total, day or month")
                .with("period", crate::text::truncate_chars(period, 64)),
        ),
    }
}

/// What a budget counts, besides money in a currency (its code, as `record_cost` takes it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Meter {
    /// Tokens of the recorded costs' usage (`tokens_of`).
    Tokens,
    /// Executions handed out by `claim_tool_call(s)`.
    ToolCalls,
    /// `llm` steps created.
    LlmSteps,
}

impl Meter {
    pub const ALL: [Meter; 3] = [Meter::Tokens, Meter::ToolCalls, Meter::LlmSteps];

    pub fn as_str(self) -> &'static str {
        match self {
            Meter::Tokens => "tokens",
            Meter::ToolCalls => "tool_calls",
            Meter::LlmSteps => "llm_steps",
        }
    }
}

/// A budget's unit as stored: a meter's name (any case), else a currency code (upper-cased,
/// 22023 `UNIT_INVALID` when it is neither).
pub fn unit(unit: &str) -> Result<String> {
    if let Some(meter) = Meter::ALL
        .into_iter()
        .find(|m| m.as_str().eq_ignore_ascii_case(unit))
    {
        return Ok(meter.as_str().to_owned());
    }
    costs::currency(unit).map_err(|_| {
        LedgerError::new(
            Code::UnitInvalid,
            "unit must be tokens, tool_calls, llm_steps or a currency code such as USD",
        )
        .with("unit", crate::text::truncate_chars(unit, 64))
    })
}

/// The share of the budget at which a warning is written: above 0, at most 1 (a decimal text).
pub fn warn_ratio(text: &str) -> Result<()> {
    let value: f64 = text.parse().unwrap_or(f64::NAN);
    if value > 0.0 && value <= 1.0 {
        return Ok(());
    }
    Err(LedgerError::new(
        Code::RatioInvalid,
        "warn_ratio must be above 0 and at most 1",
    )
    .with("value", crate::text::truncate_chars(text, 64)))
}

/// The tokens a cost entry's (normalised) usage counts against a `tokens` budget: its
/// `total_tokens` when given, else its prompt and completion tokens.
pub fn tokens_of(usage: &Value) -> i64 {
    let count = |key: &str| usage.get(key).and_then(Value::as_i64);
    count("total_tokens").unwrap_or_else(|| {
        count("prompt_tokens")
            .unwrap_or(0)
            .saturating_add(count("completion_tokens").unwrap_or(0))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn units_are_meters_in_any_case_or_currency_codes() {
        assert_eq!(unit("tokens").unwrap(), "tokens");
        assert_eq!(unit("Tool_Calls").unwrap(), "tool_calls");
        assert_eq!(unit("LLM_STEPS").unwrap(), "llm_steps");
        assert_eq!(unit("usd").unwrap(), "USD");
        assert_eq!(unit("CREDITS").unwrap(), "CREDITS");
        for bad in ["", "$", "1USD", "a-b", &"X".repeat(17)] {
            assert_eq!(unit(bad).unwrap_err().code, Code::UnitInvalid, "{bad}");
        }
    }

    #[test]
    fn levels_periods_and_ratios_are_checked() {
        assert_eq!(Level::parse("run").unwrap(), Level::Run);
        assert_eq!(Level::parse("Tenant").unwrap_err().code, Code::LevelUnknown);
        assert_eq!(period("month").unwrap(), "month");
        assert_eq!(period("week").unwrap_err().code, Code::PeriodUnknown);
        for ok in ["0.8", "1", "0.0001"] {
            warn_ratio(ok).unwrap();
        }
        for bad in ["0", "-0.5", "1.01", "NaN", "Infinity"] {
            assert_eq!(
                warn_ratio(bad).unwrap_err().code,
                Code::RatioInvalid,
                "{bad}"
            );
        }
    }

    #[test]
    fn tokens_are_the_total_or_prompt_plus_completion() {
        assert_eq!(
            tokens_of(&json!({"total_tokens": 1500, "prompt_tokens": 1})),
            1500
        );
        assert_eq!(
            tokens_of(
                &json!({"prompt_tokens": 1000, "completion_tokens": 200, "cache_read_tokens": 900})
            ),
            1200
        );
        assert_eq!(tokens_of(&json!({"latency_ms": 80})), 0);
        assert_eq!(tokens_of(&json!({})), 0);
    }
}
