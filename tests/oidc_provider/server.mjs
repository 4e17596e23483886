// A real OpenID Provider (node oidc-provider, pinned in package-lock.json) for Atrium's
// end-to-end sign-in test. It listens on 127.0.0.1 only, signs with the test's throw-away
// RSA key, and re-reads its accounts file at every sign-in so a test can change a user's
// groups or email between two logins. It must never be used outside tests: the cookie key
// and the keys are test-only, and the sign-in form is deliberately minimal.
//
// Environment (all required):
//   OP_PORT      port to listen on (127.0.0.1)
//   OP_JWKS      path of a JSON file {"keys": [<private RSA JWK with kid, alg RS256>]}
//   OP_CLIENTS   path of a JSON file: a list of oidc-provider client metadata objects
//   OP_ACCOUNTS  path of a JSON file {"<login>": {"password": "...", "sub": "...", "claims": {...}}}
import fs from 'node:fs';
import http from 'node:http';
import { URLSearchParams } from 'node:url';

import Provider from 'oidc-provider';

const port = Number(process.env.OP_PORT);
const issuer = `http://127.0.0.1:${port}`;
const readJson = (name) => JSON.parse(fs.readFileSync(process.env[name], 'utf8'));

// Re-read on every use: the test edits this file between logins.
const accounts = () => readJson('OP_ACCOUNTS');
const accountBySub = (sub) => Object.values(accounts()).find((a) => a.sub === sub);

const configuration = {
  clients: readJson('OP_CLIENTS'),
  jwks: readJson('OP_JWKS'),
  cookies: { keys: ['test-only-cookie-key-never-in-production'] },
  // Authorization code flow only, and PKCE (S256, the only method oidc-provider 9 knows)
  // for every client, confidential ones included.
  responseTypes: ['code'],
  pkce: { required: () => true },
  claims: {
    openid: ['sub'],
    email: ['email', 'email_verified'],
    profile: ['name', 'preferred_username'],
    groups: ['groups'],
  },
  features: { devInteractions: { enabled: false } },
  interactions: { url: (ctx, interaction) => `/interaction/${interaction.uid}` },
  async findAccount(ctx, sub) {
    const account = accountBySub(sub);
    if (!account) return undefined;
    return { accountId: sub, claims: async () => ({ ...account.claims, sub }) };
  },
  // First-party clients only: consent is implied (as a company IdP configures Atrium).
  async loadExistingGrant(ctx) {
    const grantId = ctx.oidc.result?.consent?.grantId || ctx.oidc.session.grantIdFor(ctx.oidc.client.clientId);
    if (grantId) {
      const existing = await ctx.oidc.provider.Grant.find(grantId);
      if (existing) return existing;
    }
    const grant = new ctx.oidc.provider.Grant({
      clientId: ctx.oidc.client.clientId,
      accountId: ctx.oidc.session.accountId,
    });
    grant.addOIDCScope('openid email profile groups');
    await grant.save();
    return grant;
  },
  ttl: { IdToken: 300, AccessToken: 300, AuthorizationCode: 60, Interaction: 300, Session: 3600, Grant: 3600 },
};

const provider = new Provider(issuer, configuration);

const esc = (s) => String(s).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

function loginForm(uid, error) {
  return `<!doctype html><html><head><title>Sign-in</title></head><body>
<h1>Test OpenID Provider</h1>${error ? `<p class="error">${esc(error)}</p>` : ''}
<form method="post" action="/interaction/${esc(uid)}">
<input type="text" name="login" autofocus><input type="password" name="password">
<button type="submit">Sign in</button></form></body></html>`;
}

async function readBody(req) {
  const chunks = [];
  for await (const chunk of req) chunks.push(chunk);
  return new URLSearchParams(Buffer.concat(chunks).toString('utf8'));
}

// The interaction (sign-in) step, in front of the provider's own routes.
async function interaction(req, res, uid) {
  const details = await provider.interactionDetails(req, res);
  if (details.uid !== uid) {
    res.writeHead(400).end('interaction mismatch');
    return;
  }
  if (details.prompt.name !== 'login') {
    // Consent is implied by loadExistingGrant; nothing else is expected here.
    res.writeHead(501).end(`prompt ${details.prompt.name} not implemented`);
    return;
  }
  if (req.method === 'GET') {
    res.writeHead(200, { 'content-type': 'text/html; charset=utf-8', 'cache-control': 'no-store' });
    res.end(loginForm(uid));
    return;
  }
  const body = await readBody(req);
  const account = accounts()[body.get('login') || ''];
  if (!account || account.password !== body.get('password')) {
    res.writeHead(200, { 'content-type': 'text/html; charset=utf-8', 'cache-control': 'no-store' });
    res.end(loginForm(uid, 'wrong login or password'));
    return;
  }
  await provider.interactionFinished(req, res, { login: { accountId: account.sub } }, { mergeWithLastSubmission: false });
}

const handle = provider.callback();
const server = http.createServer((req, res) => {
  const match = /^\/interaction\/([\w-]+)$/.exec(new URL(req.url, issuer).pathname);
  if (!match) {
    handle(req, res);
    return;
  }
  interaction(req, res, match[1]).catch((err) => {
    res.writeHead(500, { 'content-type': 'text/plain' }).end(String(err));
  });
});

server.listen(port, '127.0.0.1', () => {
  // The test waits for this line before it starts a login.
  process.stdout.write(`READY ${issuer}\n`);
});

const stop = () => server.close(() => process.exit(0));
process.on('SIGTERM', stop);
process.on('SIGINT', stop);
