-- A normalized listing of everything the extension consists of, for comparing an upgraded
-- database with a fresh install (pgrx-tests/upgrade.sh). Column order is left out on purpose:
-- an upgrade adds columns at the end.
\pset tuples_only on
\pset format unaligned
WITH ext AS (SELECT oid FROM pg_extension WHERE extname = 'ledger'),
ns AS (SELECT oid FROM pg_namespace WHERE nspname IN ('ledger', 'ledger_dispatch'))
SELECT line FROM (
  SELECT 'member ' || pg_describe_object(d.classid, d.objid, 0) AS line
    FROM pg_depend d, ext
   WHERE d.refclassid = 'pg_extension'::regclass AND d.refobjid = ext.oid AND d.deptype = 'e'
  UNION ALL
  SELECT 'function ' || p.oid::regprocedure || ' (' || pg_get_function_arguments(p.oid) || ') -> '
         || pg_get_function_result(p.oid) || ' vol=' || p.provolatile::text || ' strict=' || p.proisstrict
         || ' secdef=' || p.prosecdef || ' parallel=' || p.proparallel::text
         || ' config=' || coalesce(array_to_string(p.proconfig, ','), '')
         || ' owner=' || p.proowner::regrole || ' acl=' || coalesce(p.proacl::text, '')
         || ' comment=' || md5(coalesce(obj_description(p.oid, 'pg_proc'), ''))
    FROM pg_proc p, ns WHERE p.pronamespace = ns.oid
  UNION ALL
  SELECT 'relation ' || c.relname || ' kind=' || c.relkind::text || ' rls=' || c.relrowsecurity
         || ' force=' || c.relforcerowsecurity || ' owner=' || c.relowner::regrole
         || ' acl=' || coalesce(c.relacl::text, '') || ' options=' || coalesce(array_to_string(c.reloptions, ','), '')
         || ' comment=' || md5(coalesce(obj_description(c.oid, 'pg_class'), ''))
    FROM pg_class c, ns WHERE c.relnamespace = ns.oid
  UNION ALL
  SELECT 'column ' || c.relname || '.' || a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
         || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END
         || coalesce(' default ' || pg_get_expr(ad.adbin, ad.adrelid), '')
         || ' comment=' || md5(coalesce(col_description(c.oid, a.attnum), ''))
    FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid
    LEFT JOIN pg_attrdef ad ON ad.adrelid = c.oid AND ad.adnum = a.attnum, ns
   WHERE c.relnamespace = ns.oid AND a.attnum > 0 AND NOT a.attisdropped
  UNION ALL
  SELECT 'constraint ' || con.conrelid::regclass || ' ' || pg_get_constraintdef(con.oid)
    FROM pg_constraint con, ns WHERE con.connamespace = ns.oid
  UNION ALL
  SELECT 'index ' || regexp_replace(pg_get_indexdef(i.indexrelid), 'INDEX \S+ ON', 'INDEX ON')
    FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid, ns WHERE c.relnamespace = ns.oid
  UNION ALL
  SELECT 'policy ' || pol.polrelid::regclass || ' ' || pol.polname || ' ' || pol.polcmd::text || ' ' || pol.polroles::regrole[]::text || ' '
         || coalesce(pg_get_expr(pol.polqual, pol.polrelid), '') || ' / '
         || coalesce(pg_get_expr(pol.polwithcheck, pol.polrelid), '')
    FROM pg_policy pol JOIN pg_class c ON c.oid = pol.polrelid, ns WHERE c.relnamespace = ns.oid
  UNION ALL
  SELECT 'view ' || c.relname || ' ' || md5(pg_get_viewdef(c.oid))
    FROM pg_class c, ns WHERE c.relnamespace = ns.oid AND c.relkind = 'v'
  UNION ALL
  SELECT 'dumped ' || cfg::regclass FROM pg_extension, unnest(extconfig) cfg WHERE extname = 'ledger'
) s ORDER BY line;
