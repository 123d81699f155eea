// Builds require-header.js into a component for the `policy` world:
//   node componentize.mjs SOURCE WIT_DIR OUT
// The engine's own features that would import more than the host gives
// (wasi:http for fetch, and the rest) are left out.
import { componentize } from '@bytecodealliance/componentize-js';
import { writeFile } from 'node:fs/promises';

const [sourcePath, witPath, out] = process.argv.slice(2);
const { component } = await componentize({
  sourcePath,
  witPath,
  worldName: 'policy',
  disableFeatures: ['http', 'fetch-event', 'random', 'stdio', 'clocks'],
});
await writeFile(out, component);
