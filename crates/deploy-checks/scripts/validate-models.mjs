// Validates Kubernetes objects with the validators that `kubernetes-models` and
// `@kubernetes-models/keda` generate from the Kubernetes OpenAPI and KEDA CRD schemas.
// Usage: node validate-models.mjs <node_modules dir> <objects.json>
// The JSON file holds an array of objects. Prints one line per object; exits 1 if any object is
// invalid or has no known model (an unknown kind is a failure, not a skip).
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";
import { join } from "node:path";

const [modulesDir, objectsFile] = process.argv.slice(2);
const objects = JSON.parse(readFileSync(objectsFile, "utf8"));

function modulePath(apiVersion) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  if (group === "keda.sh" || group === "eventing.keda.sh") {
    return join(modulesDir, "@kubernetes-models/keda", group, version, "index.js");
  }
  return join(modulesDir, "kubernetes-models", group === "" ? version : `${group}/${version}`, "index.js");
}

let failed = 0;
for (const object of objects) {
  const label = `${object.kind}/${object.metadata?.name}`;
  try {
    const models = await import(pathToFileURL(modulePath(object.apiVersion)).href);
    const Model = models[object.kind];
    if (typeof Model !== "function") throw new Error(`no model for ${object.apiVersion} ${object.kind}`);
    new Model(object).validate();
    console.log(`ok ${label}`);
  } catch (error) {
    failed += 1;
    console.log(`INVALID ${label}: ${error.message}`);
  }
}
process.exit(failed === 0 ? 0 : 1);
