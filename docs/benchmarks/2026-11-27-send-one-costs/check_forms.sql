-- The same rule on a status column four ways, 20,000 single-row inserts each in one PL/pgSQL
-- loop, three alternations: what a CHECK costs a statement that writes one row.
-- Run: psql -h 127.0.0.1 -U root -d SCRATCH_DATABASE -f check_forms.sql (temp objects only)
\timing on
CREATE DOMAIN pg_temp.status_domain AS text
    CHECK (VALUE IN ('scheduled','ready','running','retrying','succeeded','dead','cancelled'));
CREATE TYPE pg_temp.status_enum AS ENUM
    ('scheduled','ready','running','retrying','succeeded','dead','cancelled');
CREATE TEMP TABLE bare (id int, status text);
CREATE TEMP TABLE table_check (id int, status text
    CHECK (status IN ('scheduled','ready','running','retrying','succeeded','dead','cancelled')));
CREATE TEMP TABLE domain_check (id int, status pg_temp.status_domain);
CREATE TEMP TABLE enum_type (id int, status pg_temp.status_enum);
\set bare 'DO $$ BEGIN FOR i IN 1..20000 LOOP INSERT INTO bare VALUES (i, ''scheduled''); END LOOP; END $$;'
\set table_check 'DO $$ BEGIN FOR i IN 1..20000 LOOP INSERT INTO table_check VALUES (i, ''scheduled''); END LOOP; END $$;'
\set domain_check 'DO $$ BEGIN FOR i IN 1..20000 LOOP INSERT INTO domain_check VALUES (i, ''scheduled''); END LOOP; END $$;'
\set enum_type 'DO $$ BEGIN FOR i IN 1..20000 LOOP INSERT INTO enum_type VALUES (i, ''scheduled''); END LOOP; END $$;'
\echo text, no check
:bare
\echo text with the table CHECK
:table_check
\echo a domain over text with that CHECK
:domain_check
\echo an enum
:enum_type
\echo text, no check
:bare
\echo text with the table CHECK
:table_check
\echo a domain over text with that CHECK
:domain_check
\echo an enum
:enum_type
\echo text, no check
:bare
\echo text with the table CHECK
:table_check
\echo a domain over text with that CHECK
:domain_check
\echo an enum
:enum_type
