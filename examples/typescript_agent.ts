// A minimal mep agent in TypeScript: claims a name and its memory file, works in a loop,
// syncs the memory under the fencing token, and stops cleanly when the lease is lost.
// Build and run (see clients/typescript/README.md): node typescript_agent.js NAME FILE.uai [STEPS]
import { appendFile } from "node:fs/promises";
import { setTimeout as sleep } from "node:timers/promises";
import * as mep from "@mep/client";

const [name = "example-agent", file = "example-agent.uai", steps = "Infinity"] = process.argv.slice(2);
await mep.init(file).catch((e) => { if (!(e instanceof mep.InvalidRequest)) throw e; }); // exists: fine

await using lease = await mep.lease(name, file, { ttl: 10 }); // released when this scope ends
console.log(`holding "${lease.canonicalName}" (memory ${lease.memoryInstanceId}, token ${lease.token})`);
lease.on("atRisk", ({ reason }) => console.warn(`lease at risk (${reason}); carrying on until it is lost`));
process.once("SIGINT", () => void lease.release());

try {
  for (let step = 1; step <= Number(steps); step++) {
    lease.check(); // never write without the lease
    await appendFile(file, `step ${step} at ${new Date().toISOString()}\n`);
    await lease.sync().catch((e) => { // upload under the fence; a stale token is refused
      if (!(e instanceof mep.StoreNotConfigured || e instanceof mep.NotFound)) throw e; // no data plane here
    });
    await sleep(1000, undefined, { signal: lease.signal }); // wakes at once on loss
  }
} catch (e) {
  if (!lease.signal.aborted) throw e;
}
if (lease.isLost) {
  console.error(`lease lost (${lease.lostReason}): stopped`);
  process.exitCode = 4; // as `mep run`
} else console.log("done");
