import fs from 'node:fs';
const f = fs.readdirSync('.').find((x) => x.endsWith('.cpuprofile'));
const p = JSON.parse(fs.readFileSync(f));
const self = new Map(); const byId = new Map(p.nodes.map((n) => [n.id, n]));
const dt = p.timeDeltas; const counts = new Map();
p.samples.forEach((id, i) => counts.set(id, (counts.get(id) ?? 0) + (dt[i] ?? 0)));
// inclusive time
const parent = new Map(); for (const n of p.nodes) for (const c of n.children ?? []) parent.set(c, n.id);
const incl = new Map();
for (const [id, t] of counts) { let cur = id; const seen = new Set(); while (cur !== undefined) { const n = byId.get(cur); const key = `${n.callFrame.functionName || '(anon)'} ${n.callFrame.url.split('/').slice(-2).join('/')}:${n.callFrame.lineNumber}`; if (!seen.has(key)) { incl.set(key, (incl.get(key) ?? 0) + t); seen.add(key); } cur = parent.get(cur); } 
  const n = byId.get(id); const key = `${n.callFrame.functionName || '(anon)'} ${n.callFrame.url.split('/').slice(-2).join('/')}:${n.callFrame.lineNumber}`; self.set(key, (self.get(key) ?? 0) + t); }
const total = [...counts.values()].reduce((a, b) => a + b, 0);
const show = (m, title, filt) => { console.log(title); [...m].filter(([k]) => !filt || filt(k)).sort((a, b) => b[1] - a[1]).slice(0, 40).forEach(([k, v]) => console.log((v / total * 100).toFixed(1).padStart(5), k)); };
show(self, 'SELF');
show(incl, 'INCL (src/drizzle)', (k) => /src\/|drizzle|repo|driver|otel|postgres/.test(k));
