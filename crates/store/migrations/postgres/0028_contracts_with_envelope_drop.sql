-- PostgreSQL fixes a view's columns when it is created: `c.*` in
-- contracts_with_envelope does not take stale_judgments (0027) until the
-- view is made again (0029). One DDL statement per migration.
DROP VIEW contracts_with_envelope;
