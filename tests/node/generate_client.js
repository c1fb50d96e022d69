#!/usr/bin/env node
// Streams one greedy Generate from a Tandem frontend and prints the result as JSON:
//   node tests/node/generate_client.js HOST:PORT "prompt text" [max_tokens] [json_schema]
// With a JSON schema the output is constrained to it (structured output, compact JSON)
// and the request stops when the JSON is complete.
// -> {"text": "...", "token_ids": [...], "num_tokens": N, "finish_reason": "length",
//     "prompt_token_ids": [...], "messages": M}
// Exits 1 with the gRPC status on stderr if the call fails.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const [address, prompt, maxTokensArg, schema] = process.argv.slice(2);
if (!address || prompt === undefined) {
  console.error('usage: generate_client.js HOST:PORT PROMPT [MAX_TOKENS]');
  process.exit(2);
}
const maxTokens = Number(maxTokensArg || 16);

const protos = path.resolve(__dirname, '..', '..', 'protos');
const definition = protoLoader.loadSync('tandem/v1/frontend.proto', {
  includeDirs: [protos],
  keepCase: true,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
});
const tandem = grpc.loadPackageDefinition(definition).tandem.v1;
const client = new tandem.Generation(address, grpc.credentials.createInsecure());

const request = {
  prompt,
  sampling_params: {
    temperature: 0, // proto3 optional: sent even though it is the zero value
    max_tokens: maxTokens,
    ignore_eos: true,
    output_kind: 'OUTPUT_KIND_DELTA',
  },
};
if (schema) {
  request.sampling_params.ignore_eos = false;
  request.sampling_params.structured_outputs = { json: schema, disable_any_whitespace: true };
}

const result = { text: '', token_ids: [], num_tokens: 0, finish_reason: '', prompt_token_ids: [], messages: 0 };
const call = client.Generate(request, { deadline: Date.now() + 60000 });
call.on('data', (response) => {
  result.messages += 1;
  if (response.prompt_token_ids.length) result.prompt_token_ids = response.prompt_token_ids;
  for (const out of response.outputs) {
    if (out.index !== 0) continue;
    result.text += out.text;
    result.token_ids.push(...out.token_ids);
    if (out.finish_reason) result.finish_reason = out.finish_reason;
  }
});
call.on('error', (err) => {
  console.error(`error: ${grpc.status[err.code]}: ${err.details}`);
  client.close();
  process.exit(1);
});
call.on('end', () => {
  result.num_tokens = result.token_ids.length;
  process.stdout.write(JSON.stringify(result) + '\n');
  client.close();
});
