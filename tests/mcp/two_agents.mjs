// Two agents on one memory file through the official memory server
// (@modelcontextprotocol/server-memory), each creating 20 entities, one call after the other,
// both agents at the same time, with and without mep. Prints how many of the 40 entities the file kept.
//
//   node two_agents.mjs bare FILE          two memory servers on FILE, side by side
//   node two_agents.mjs mep FILE [MEP]     each under `mep run --wait 120 graph-keeper FILE --`
//                                          (MEP: the mep binary; mepd must be running)
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StdioClientTransport } from '@modelcontextprotocol/sdk/client/stdio.js';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const [mode, file, mep = 'mep'] = process.argv.slice(2);
if (!['bare', 'mep'].includes(mode) || !file) {
  console.error('usage: node two_agents.mjs bare|mep FILE [MEP]');
  process.exit(2);
}
const here = path.dirname(fileURLToPath(import.meta.url));
const memoryServer = path.join(here, 'node_modules/@modelcontextprotocol/server-memory/dist/index.js');
const target = path.resolve(file);
const PER_AGENT = Number(process.env.PER_AGENT ?? 20);

async function agent(label) {
  const server = [process.execPath, memoryServer];
  const [command, ...args] =
    mode === 'bare' ? server : [mep, 'run', '--wait', '120', 'graph-keeper', target, '--', ...server];
  const transport = new StdioClientTransport({
    command, args, env: { ...process.env, MEMORY_FILE_PATH: target }, stderr: 'ignore',
  });
  const client = new Client({ name: label, version: '0' });
  await client.connect(transport, { timeout: 180000 });
  // One call after the other, as an agent makes them (the memory server loses writes even
  // within one process when calls overlap).
  for (let i = 0; i < PER_AGENT; i++)
    await client.callTool({ name: 'create_entities',
      arguments: { entities: [{ name: `${label}-${i}`, entityType: 'note', observations: [] }] } });
  await client.close();
}

const started = Date.now();
await Promise.all([agent('a'), agent('b')]);
const kept = fs.readFileSync(target, 'utf8').split('\n').filter((l) => l.trim())
  .map((l) => JSON.parse(l)).filter((e) => e.type === "entity").length;
console.log(`${mode}: ${kept} of ${2 * PER_AGENT} entities kept (${Date.now() - started} ms)`);
