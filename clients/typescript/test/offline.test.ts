/**
 * Offline verification, TypeScript alone: a chain the broker issued (GetChain
 * + GetBrokerKeys), with a bit flipped in any signed byte failing; receipts;
 * every term of "Verifying a chain" broken on its own in chains forged under
 * a test key; strict ed25519.
 */

import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import {
  Agent,
  BrokerKeys,
  CONTRACT_TYPE,
  MAX_CHAIN_CONTRACTS,
  RECEIPT_TYPE,
  VerificationError,
  conjoinPredicates,
  equalBytes,
  isUnder,
  keyId,
  pae,
  pb,
  sha256,
  verifyChain,
  verifyContract,
  verifyEverySignature,
  verifyPaeSignature,
  verifyReceipt,
  verifySealed,
} from "@delegation-broker/client";

import {
  SYNTHETIC_EFFECTIVE,
  SYNTHETIC_VIOLATIONS,
  broken,
  flippedChains,
  flippedSealed,
  forgeChain,
  published,
  sealedTamperings,
  syntheticChain,
} from "./forge.js";
import { Broker, child, issuedOf, liableChild, refusalOf } from "./support.js";

let broker: Broker;
/** orchestrator → planner (liable, attested 0.9) → executor (liable, 0.8) → reviewer (0.9). */
let chain: pb.ContractState[];
let refusal: pb.Sealed;
let accepted: pb.Sealed;

before(async () => {
  broker = await Broker.start("offline");
  const [orchestrator, planner, executor, reviewer] = Array.from({ length: 4 }, () => Agent.generate()) as [Agent, Agent, Agent, Agent];
  const root = await broker.openRoot(orchestrator, { minTrust: 500_000, predicate: "result.schema_valid" });
  const plannerId = issuedOf(
    await broker.delegate(
      orchestrator,
      liableChild(root.id, root.lineage, planner, 40n, "result.ok", { minRetryCost: 5n, delegateAttestation: broker.attest(planner, 0.9) }),
    ),
  ).contractId;
  const executorId = issuedOf(
    await broker.delegate(
      planner,
      liableChild(plannerId, root.lineage, executor, 20n, "", { writeScope: ["src/auth"], delegateAttestation: broker.attest(executor, 0.8) }),
    ),
  ).contractId;
  const leafId = issuedOf(
    await broker.delegate(
      executor,
      child(executorId, root.lineage, reviewer, 5n, { writeScope: ["src/auth/a.rs"], delegateAttestation: broker.attest(reviewer, 0.9) }),
    ),
  ).contractId;
  const refused = await broker.delegate(
    planner,
    child(plannerId, root.lineage, Agent.generate(), 5n, { delegateAttestation: broker.attest(Agent.generate(), 0.3) }),
  );
  assert.equal(refusalOf(refused).primary, pb.InvariantCode.TRUST_ATTENUATED);
  refusal = refused.refused!.sealed;
  accepted = (await broker.client.accept(planner.accept({ contractId: plannerId }))).receipt!;
  chain = (await broker.client.getChain({ contractId: leafId })).chain;
});
after(async () => {
  await broker.close();
});

test("a chain from GetChain verifies from GetBrokerKeys alone: terms, trust, effective predicates", () => {
  const leafId = chain.at(-1)!.contractId;
  const verified = verifyChain(chain, broker.keys, leafId);
  verifyEverySignature(chain, broker.keys);
  assert.equal(verified.length, 4);
  assert.deepEqual(
    verified.map((v) => v.effectivePredicate),
    ["(result.schema_valid\n)", "(result.schema_valid\n) && (result.ok\n)", "(result.schema_valid\n) && (result.ok\n)", ""],
  );
  assert.deepEqual(verified.map((v) => v.effectivePredicate), chain.map((s) => s.effectivePredicate), "the broker's copy agrees");
  assert.deepEqual(verified.map((v) => v.contract.cumulativeTrustPpm), [1_000_000, 900_000, 720_000, 648_000]);
  verified.forEach((v, i) => {
    assert.ok(equalBytes(v.contractId, chain[i]!.contractId));
    assert.equal(v.keyId, broker.keys.current);
    if (i > 0) assert.ok(equalBytes(v.principalPublicKey!, verified[i - 1]!.contract.delegatePublicKey));
  });
  // The same from the response, from the Sealed contracts, and a prefix as the chain of its last contract.
  verifyChain(create(pb.GetChainResponseSchema, { chain }), broker.keys, leafId);
  verifyChain(chain.map((s) => s.contract!), broker.keys, leafId);
  assert.equal(verifyChain(chain.slice(0, 2), broker.keys, chain[1]!.contractId).length, 2);
  // One contract alone: a root fully, a child as far as it goes.
  assert.equal(verifyContract(chain[0]!.contract!, broker.keys, chain[0]!.contractId).effectivePredicate, "(result.schema_valid\n)");
  assert.equal(verifyContract(chain[2]!.contract!, broker.keys).effectivePredicate, undefined);
});

test("a bit flipped in any signed byte of the chain fails verification", () => {
  let variants = 0;
  for (const [name, variant] of flippedChains(chain)) {
    assert.throws(() => verifyChain(variant, broker.keys), VerificationError, name);
    variants++;
  }
  assert.ok(variants > 4 * 100, `${variants} variants`);
});

test("swapped, cut, spliced, repeated, foreign: none verifies", () => {
  const genuine = chain.map((s) => s.contract!);
  const fails = (c: pb.Sealed[], id?: Uint8Array, keys = broker.keys) => assert.throws(() => verifyChain(c, keys, id), VerificationError);
  for (const [a, b] of [[0, 1], [1, 2], [2, 3]] as const) {
    const swapped = [...genuine];
    [swapped[a], swapped[b]] = [swapped[b]!, swapped[a]!];
    fails(swapped);
  }
  fails(genuine.slice(1)); // no root
  fails([...genuine.slice(0, 2), ...genuine.slice(3)]); // missing middle
  fails([genuine[0]!, ...genuine]); // the root twice
  fails(Array.from({ length: 17 }, () => genuine).flat()); // more than 65 contracts
  assert.ok(17 * 4 > MAX_CHAIN_CONTRACTS);
  fails([]);
  fails(genuine, chain[2]!.contractId); // not the contract asked for
  fails(genuine, undefined, published(Agent.generate())); // a stranger's key
  fails([accepted]); // a receipt is not a contract
  // An ancestor's signature flipped: the leaf's still proves every term, but not every signature verifies.
  const tampered = [...genuine];
  tampered[1] = sealedTamperings(genuine[1]!)[3]![1];
  verifyChain(tampered, broker.keys);
  assert.throws(() => verifyEverySignature(tampered, broker.keys), (e: VerificationError) => e.index === 1);
});

test("receipts verify, and a bit flipped anywhere in one fails", () => {
  for (const sealed of [refusal, accepted]) {
    const verified = verifyReceipt(sealed, broker.keys, sha256(sealed.payload));
    assert.ok(equalBytes(verified.id, sha256(sealed.payload)));
    for (const [name, variant] of flippedSealed(sealed)) {
      assert.throws(() => verifyReceipt(variant, broker.keys), VerificationError, name);
    }
    for (const [name, variant] of sealedTamperings(sealed)) {
      if (name === "genuine") verifyReceipt(variant, broker.keys);
      else assert.throws(() => verifyReceipt(variant, broker.keys), VerificationError, name);
    }
    assert.throws(() => verifyReceipt(sealed, broker.keys, new Uint8Array(32)), VerificationError);
    assert.throws(() => verifyReceipt(sealed, published(Agent.generate())), VerificationError);
  }
  const receipt = verifyReceipt(refusal, broker.keys).message;
  assert.equal(receipt.kind, pb.ReceiptKind.REFUSED);
  assert.equal(receipt.primary, pb.InvariantCode.TRUST_ATTENUATED);
  // A contract is not a receipt, a receipt not a session: the type is bound through PAE.
  assert.throws(() => verifyReceipt(chain[0]!.contract!, broker.keys), VerificationError);
  assert.throws(() => verifySealed(accepted, broker.keys, pb.SessionSchema), VerificationError);
  assert.throws(() => verifyReceipt(create(pb.EnvelopeSchema) as unknown as pb.Sealed, broker.keys), TypeError);
});

test("chains forged under a test key: the genuine one verifies, each broken term fails with its message", () => {
  const signer = Agent.generate();
  const keys = published(signer);
  const genuine = forgeChain(signer, syntheticChain());
  assert.deepEqual(verifyChain(genuine, keys).map((v) => v.effectivePredicate), SYNTHETIC_EFFECTIVE);
  verifyEverySignature(genuine, keys);
  for (const [name, message, edit] of SYNTHETIC_VIOLATIONS) {
    assert.throws(() => verifyChain(forgeChain(signer, broken(edit)), keys), (e: unknown) => {
      assert.ok(e instanceof VerificationError, name);
      assert.ok(e.message.startsWith(message), `${name}: ${e.message}`);
      return true;
    });
  }
  assert.throws(() => verifyChain(forgeChain(signer, syntheticChain(), false), keys), /contract 1: parent_id is not the id of contract 0/);
  // "/" covers every absolute path, and only those.
  const [root, first] = syntheticChain() as [pb.Contract, pb.Contract];
  root.writeScope = ["/"];
  first.writeScope = ["/etc", "/"];
  verifyChain(forgeChain(signer, [root, first]), keys);
  first.writeScope.push("etc");
  assert.throws(() => verifyChain(forgeChain(signer, [root, first]), keys), /write_scope reaches outside/);
});

test("the scope rule and the predicate conjunction, as types.proto states them", () => {
  assert.ok(isUnder("src/a", "src") && isUnder("src", "src") && !isUnder("srcx", "src") && !isUnder("/src", "src"));
  assert.ok(isUnder("/etc", "/") && !isUnder("etc", "/"));
  assert.equal(conjoinPredicates("", ""), "");
  assert.equal(conjoinPredicates("", "a"), "(a\n)");
  assert.equal(conjoinPredicates("(a\n)", ""), "(a\n)");
  assert.equal(conjoinPredicates("(a\n)", "b // c"), "(a\n) && (b // c\n)");
  assert.throws(() => conjoinPredicates("", "é".repeat(32_768)), /exceeds 65536 bytes/, "bytes, not characters");
});

test("published keys: each id must match its key", () => {
  const agent = Agent.generate();
  assert.throws(() => new BrokerKeys([create(pb.BrokerKeySchema, { keyId: "ed25519:" + "00".repeat(16), publicKey: agent.publicKey })]), VerificationError);
  assert.throws(() => new BrokerKeys([create(pb.BrokerKeySchema, { keyId: "x", publicKey: new Uint8Array(31) })]), VerificationError);
  assert.throws(() => new BrokerKeys([]), VerificationError);
  const keys = BrokerKeys.fromPublicKeys([agent.publicKey]);
  assert.deepEqual(keys.ids(), [keyId(agent.publicKey)]);
  assert.equal(keys.current, undefined);
});

test("strict ed25519: RFC 8032 vectors sign alike; small-order and non-canonical encodings never verify", () => {
  const hex = (s: string) => Uint8Array.from(s.match(/../g)!.map((b) => parseInt(b, 16)));
  // RFC 8032 §7.1, TEST 1 and TEST 2.
  const one = Agent.fromSeed(hex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60"));
  assert.ok(equalBytes(one.publicKey, hex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")));
  assert.ok(
    equalBytes(
      one.signRaw(new Uint8Array()),
      hex("e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b"),
    ),
  );
  const two = Agent.fromSeed(hex("4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb"));
  assert.ok(
    equalBytes(
      two.signRaw(hex("72")),
      hex("92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da085ac1e43e15996e458f3613d0f11d8c387b2eaeb4302aeeb00d291612bb0c00"),
    ),
  );

  const payload = new TextEncoder().encode("payload");
  const signature = one.signRaw(pae(CONTRACT_TYPE, payload));
  assert.ok(verifyPaeSignature(CONTRACT_TYPE, payload, signature, one.publicKey));
  assert.ok(!verifyPaeSignature(RECEIPT_TYPE, payload, signature, one.publicKey), "the type is signed");
  assert.ok(!verifyPaeSignature(CONTRACT_TYPE, payload, signature, two.publicKey));
  // The identity as key and R with S = 0 satisfies [S]B = R + [k]A for any message: refused (small order).
  const identity = new Uint8Array(32);
  identity[0] = 1;
  assert.ok(!verifyPaeSignature(CONTRACT_TYPE, payload, Uint8Array.from([...identity, ...new Uint8Array(32)]), identity));
  // A small-order R with an honest key: refused whatever S.
  assert.ok(!verifyPaeSignature(CONTRACT_TYPE, payload, Uint8Array.from([...identity, ...signature.subarray(32)]), one.publicKey));
  // A non-canonical key encoding (y = p + 1 ≥ p): refused.
  const nonCanonical = new Uint8Array(32).fill(0xff);
  nonCanonical[0] = 0xee;
  nonCanonical[31] = 0x7f;
  assert.ok(!verifyPaeSignature(CONTRACT_TYPE, payload, signature, nonCanonical));
  assert.ok(!verifyPaeSignature(CONTRACT_TYPE, payload, signature.subarray(0, 63), one.publicKey));
  assert.ok(!verifyPaeSignature(CONTRACT_TYPE, payload, signature, one.publicKey.subarray(0, 31)));
});

test("PAE, key ids and the lineage hash, byte for byte", () => {
  assert.equal(new TextDecoder().decode(pae("t", new TextEncoder().encode("hi"))), "DSSEv1 1 t 2 hi");
  assert.equal(new TextDecoder().decode(pae("é", new Uint8Array())), "DSSEv1 2 é 0 ", "lengths in bytes");
  const big = pae(CONTRACT_TYPE, new Uint8Array(70_000));
  const head = `DSSEv1 ${CONTRACT_TYPE.length} ${CONTRACT_TYPE} 70000 `;
  assert.equal(new TextDecoder().decode(big.subarray(0, head.length)), head, "a multi-digit length");
  assert.equal(big.length, head.length + 70_000);
  const signed = Agent.generate();
  assert.equal(signed.keyId, "ed25519:" + Array.from(sha256(signed.publicKey).subarray(0, 16), (b) => b.toString(16).padStart(2, "0")).join(""));
  const body = fromBinary(pb.DelegateBodySchema, signed.delegate({ task: "t", budget: 1n }).signed!.payload);
  assert.equal(body.header!.nonce.length, 16);
  assert.ok(equalBytes(body.header!.agentPublicKey, signed.publicKey));
  assert.ok(toBinary(pb.DelegateBodySchema, body).length > 0);
});
