-- Version 2: listings page through an index in name order (the (tenant, owner) index made
-- every page sort all of the tenant's leases).
DROP INDEX IF EXISTS leases_owner;
CREATE INDEX IF NOT EXISTS leases_owner_name ON leases(tenant_id, owner_client_id, canonical_name);
CREATE INDEX IF NOT EXISTS leases_tenant_name ON leases(tenant_id, canonical_name);
