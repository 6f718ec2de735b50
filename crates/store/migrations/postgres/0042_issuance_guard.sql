-- The check an optimistic issuance makes before it takes the event clock
-- (`store::postgres::writer`): it wrote from the parents its writer had
-- cached, each update guarded by the row's version, so `rows_ok` false
-- means a parent changed since (SQLSTATE BR001), and no tree of `roots`
-- may be draining (BR002). Either aborts the statement, which is redone
-- with the parents locked and read. VOLATILE: the drains are read with a
-- snapshot taken now, after the statement's row locks (a drain committed
-- while it waited for one is seen), not with the statement's own.
CREATE FUNCTION issuance_guard(rows_ok boolean, roots bigint[]) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF NOT rows_ok THEN
        RAISE EXCEPTION 'a cached parent changed' USING ERRCODE = 'BR001';
    END IF;
    IF EXISTS (SELECT 1 FROM draining WHERE root_seq = ANY(roots)) THEN
        RAISE EXCEPTION 'a tree is draining' USING ERRCODE = 'BR002';
    END IF;
    RETURN true;
END
$$;
