import { defineConfig } from 'drizzle-kit';

// Generates palisade's own migrations (schema `palisade`) into drizzle/.
// `npx drizzle-kit generate` needs no database.
export default defineConfig({
  dialect: 'postgresql',
  schema: './src/schema/palisade.ts',
  out: './drizzle',
});
