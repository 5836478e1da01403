//! `Jsonb`: a `jsonb` value carried as the text PostgreSQL prints for it.
//!
//! pgrx's own `JsonB` parses every argument into a `serde_json::Value` on the way in, and
//! panics (XX000) on input nested deeper than serde_json's recursion limit. The ledger instead
//! takes the text as it is, parses only where it needs to, with a depth check first
//! (`ledger_model::json`), and stores values it does not need to look into without touching them.

use pgrx::callconv::{Arg, ArgAbi, BoxRet, FcInfo};
use pgrx::datum::Datum;
use pgrx::nullable::Nullable;
use pgrx::{direct_function_call, direct_function_call_as_datum, pg_sys, FromDatum, IntoDatum};
use std::ffi::{CStr, CString};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Jsonb(pub String);

impl Jsonb {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The value, parsed (jsonb's text always parses).
    pub fn value(&self) -> crate::error::Result<serde_json::Value> {
        serde_json::from_str(&self.0)
            .map_err(|e| crate::error::LedgerError::internal(format!("jsonb text: {e}")))
    }

    /// True when the value is a JSON object (jsonb prints no leading whitespace).
    pub fn is_object(&self) -> bool {
        self.0.starts_with('{')
    }
}

impl From<&serde_json::Value> for Jsonb {
    fn from(v: &serde_json::Value) -> Self {
        Jsonb(ledger_model::json::canonical(v))
    }
}

impl FromDatum for Jsonb {
    unsafe fn from_polymorphic_datum(
        datum: pg_sys::Datum,
        is_null: bool,
        _: pg_sys::Oid,
    ) -> Option<Self> {
        if is_null {
            return None;
        }
        // SAFETY: the datum is a jsonb (the SQL signature says so); jsonb_out detoasts it and
        // returns a palloc'd string, freed after copying.
        unsafe {
            let text = direct_function_call::<&CStr>(pg_sys::jsonb_out, &[Some(datum)])?;
            let owned = text.to_string_lossy().into_owned();
            pg_sys::pfree(text.as_ptr() as *mut std::ffi::c_void);
            Some(Jsonb(owned))
        }
    }
}

impl IntoDatum for Jsonb {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        // jsonb text never holds a raw NUL (jsonb refuses \u0000 too).
        let text = CString::new(self.0).ok()?;
        // SAFETY: jsonb_in parses a NUL-terminated string and raises a normal ERROR on bad input.
        unsafe {
            direct_function_call_as_datum(
                pg_sys::jsonb_in,
                &[Some(pg_sys::Datum::from(text.as_ptr()))],
            )
        }
    }

    fn type_oid() -> pg_sys::Oid {
        pg_sys::JSONBOID
    }
}

// SAFETY: as pgrx's own impls for JsonB: the value is unboxed through FromDatum.
unsafe impl<'fcx> ArgAbi<'fcx> for Jsonb {
    unsafe fn unbox_arg_unchecked(arg: Arg<'_, 'fcx>) -> Self {
        unsafe { arg.unbox_arg_using_from_datum().unwrap_or_default() }
    }

    unsafe fn unbox_nullable_arg(arg: Arg<'_, 'fcx>) -> Nullable<Self> {
        unsafe { arg.unbox_arg_using_from_datum().into() }
    }
}

// SAFETY: returns the datum built by IntoDatum, as pgrx does for JsonB.
unsafe impl BoxRet for Jsonb {
    unsafe fn box_into<'fcx>(self, fcinfo: &mut FcInfo<'fcx>) -> Datum<'fcx> {
        match self.into_datum() {
            Some(datum) => unsafe { fcinfo.return_raw_datum(datum) },
            None => fcinfo.return_null(),
        }
    }
}

pgrx::impl_sql_translatable!(Jsonb, "jsonb");
