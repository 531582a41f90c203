import type { Command } from './common.js';

export const demoCommand: Command = {
  summary: 'the seed story: a naive lock loses an update, palisade refuses the stale write',
  help: 'Usage: palisade demo',
  async run(_argv, io) {
    io.err('not yet');
    return 1;
  },
};
